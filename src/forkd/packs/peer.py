"""Snapshots moved between nodes by digest: a node streams the layers of a chain it holds, a node pulls
the layers of a chain it lacks from a peer.

Tags are one store's names; a chain travels by its top layer's digest. What travels is a pack in
the ordinary format (``archive.write_stream``), holding only the layers the puller lacks: its root
then names its parent by tag and digest, and the puller unpacks it with the very code and checks
of ``unpack`` (``PackService.unpack_file``), which verifies the store's own ancestors it builds on
and publishes all or nothing. Ancestors keep their tags (a layer's disk names its parent's
directory by tag, e.g. as its backing file, which its digest covers); only the top
layer is renamed (``d-<digest prefix>``) when its tag is taken here.

A peer is hostile like any download: its ``/v1/node`` answer is read up to ``MAX_NODE_ANSWER``
bytes and checked against a schema, its pack is read up to what its own listing declared for the
layers asked (plus the format's overhead), a pull whose pack and layers would not fit above the
free-space floor is refused before anything is fetched, and a pack that fails verification leaves
nothing. The chain is pinned by its digest: the pack's top layer must have it.
The peer's URL passes the daemon's ``UrlPolicy``; its token goes in the ``Authorization`` header
and nowhere else (never in a message or a log line).
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import hashlib
import io
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forkd.guest.protocol import AGENT_VERSION
from forkd.packs import archive, transfer
from forkd.packs.format import MAX_CHAIN_DEPTH, MAX_FILE_BYTES, PackError
from forkd.packs.service import PackService, Progress
from forkd.store.chains import record_digest
from forkd.store.io import long_job, remove_tree
from forkd.store.registry import SnapshotRecord
from forkd.store.snapshots import HostIdentity
from forkd.vmm.base import BootSpec

MAX_NODE_ANSWER = 8 << 20  # a peer's GET /v1/node answer
MAX_LISTED = 10_000  # snapshots a peer may list
PACK_OVERHEAD_BYTES = 16 << 20  # tar headers and zstd framing on top of the layers' bytes, generously
STREAM_CHUNKS_AHEAD = 8  # chunks a served pack runs ahead of its reader
# The compat key's fields and the MachineIdentity field each one is.
COMPAT_FIELDS = {"vmm": "vmm", "vmm_version": "vmm_version", "machine": "machine", "accel": "accelerator",
                 "cpu_model": "cpu_model", "agent_version": "agent_version"}

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class PeerError(PackError):
    """A peer could not be reached, answered wrongly or sent a pack that failed verification (HTTP 502)."""

    kind = "peer_error"


class PeerSnapshotNotFound(LookupError):
    """The peer holds no snapshot with that digest (HTTP 404 ``snapshot_not_found``)."""

    kind = "snapshot_not_found"


class IncompatibleSnapshot(RuntimeError):
    """The peer's snapshots cannot be restored here: its compatibility key differs (HTTP 409)."""

    kind = "incompatible_snapshot"


class _Listed(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tag: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    digest: Sha256
    parent_digest: Sha256 | None = None
    bytes: int = Field(ge=0, le=MAX_FILE_BYTES)
    status: str = Field(max_length=32)


class _PeerNode(BaseModel):
    model_config = ConfigDict(extra="ignore")
    node_id: str = Field(max_length=128)
    compat: dict[str, str]
    snapshots: list[_Listed] = Field(max_length=MAX_LISTED)


def compat_of(host_identity: HostIdentity) -> dict[str, str]:
    """This node's restore-compatibility key: the machine fields a snapshot's identity must match here
    whatever its size (RAM, vCPUs and kernel are the snapshot's own)."""
    identity = asdict(host_identity(BootSpec(kernel=Path(), initrd=Path(), cmdline="", memory_mib=0, vcpus=0,
                                             kernel_sha256="", agent_version=AGENT_VERSION)))
    return {key: str(identity[field]) for key, field in COMPAT_FIELDS.items()}


def compat_key(compat: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(compat, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def snapshot_entry(record: SnapshotRecord, parent_digest: str | None, size: int) -> dict[str, Any]:
    return {"tag": record.tag, "digest": record_digest(record), "parent_digest": parent_digest, "bytes": size,
            "status": record.status}


# serving -------------------------------------------------------------------------------------------

def chain_to_send(packs: PackService, digest: str, have: set[str]) -> list[archive.SourceSnapshot]:
    """The chain ending at ``digest``, root first, without the root-side layers listed in ``have``
    (the top is always sent). Raises ``DigestNotFound`` when this node does not hold it."""
    chain = packs.chain(packs.store.get_digest(digest).tag)
    skip = 0
    while skip < len(chain) - 1 and record_digest(chain[skip]) in have:
        skip += 1
    below = record_digest(chain[skip - 1]) if skip else None
    return [archive.SourceSnapshot(tag=r.tag, directory=r.path, image=r.image, created_at=r.created_at,
                                   parent_tag=r.parent_tag, parent_digest=below if i == 0 else None)
            for i, r in enumerate(chain[skip:])]


class _Pipe(io.RawIOBase):
    """Where the packing thread writes: chunks handed to the event loop, at most a few ahead of the reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[bytes | BaseException | None]) -> None:
        self._loop, self._queue = loop, queue
        self.room = threading.Semaphore(STREAM_CHUNKS_AHEAD)
        self.gone = threading.Event()  # the reader left: stop packing

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        while not self.room.acquire(timeout=0.5):
            if self.gone.is_set():
                raise BrokenPipeError("the peer stopped reading")
        if self.gone.is_set():
            raise BrokenPipeError("the peer stopped reading")
        self.put(bytes(data))
        return len(data)

    def put(self, item: bytes | BaseException | None) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


async def stream_pack(chain: list[archive.SourceSnapshot]) -> AsyncIterator[bytes]:
    """The pack of ``chain`` as it is written, never on disk; a reader that leaves stops the writer."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
    pipe = _Pipe(loop, queue)

    def write() -> None:
        try:
            archive.write_stream(pipe, chain, lambda _line: None)
        except BaseException as exc:  # handed to the reader, which ends the stream (the puller sees it truncated)
            pipe.put(exc)
        else:
            pipe.put(None)

    writer = asyncio.ensure_future(long_job(write))
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            pipe.room.release()
            yield item
    finally:
        pipe.gone.set()
        with contextlib.suppress(BaseException):
            await asyncio.shield(writer)


# pulling -------------------------------------------------------------------------------------------

class PeerPuller:
    def __init__(self, packs: PackService) -> None:
        self.packs = packs
        self.store = packs.store
        # One pull per digest at a time (the second then finds it held), with how many use the lock.
        self._pulls: dict[str, tuple[asyncio.Lock, int]] = {}

    @property
    def urls(self) -> transfer.UrlPolicy:
        """The daemon's URL policy, with private addresses allowed: peers are the cluster's own nodes,
        usually on a private network, and a peer pull reaches only their node API (its answers parsed,
        never shown), so it is not the way to reach a metadata service that a pull or push would be."""
        return dataclasses.replace(self.packs.urls, private_ok=True)

    def compat(self) -> dict[str, str]:
        return compat_of(self.store.host_identity)

    async def pull(self, digest: str, source: str, token: str | None, progress: Progress) -> dict[str, Any]:
        """Pull the chain ending at ``digest`` from the node at ``source``: only the layers missing here."""
        source = self.urls.check(source.rstrip("/"))
        lock, waiting = self._pulls.get(digest, (asyncio.Lock(), 0))
        self._pulls[digest] = (lock, waiting + 1)
        try:
            async with lock:
                return await self._pull(digest, source, token, progress)
        finally:
            lock, waiting = self._pulls[digest]
            if waiting == 1:
                del self._pulls[digest]
            else:
                self._pulls[digest] = (lock, waiting - 1)

    async def _pull(self, digest: str, source: str, token: str | None, progress: Progress) -> dict[str, Any]:
        held = await asyncio.to_thread(self.store.by_digest, digest)
        if held is not None:
            return {"digest": digest, "tag": held.tag, "pulled_layers": 0, "bytes": 0}
        peer = transfer.shown(source)
        node = await self._node(source, token)
        differences = [f"{k}: {peer} has {node.compat.get(k)!r}, this node {v!r}"
                       for k, v in self.compat().items() if node.compat.get(k) != v]
        if differences:
            raise IncompatibleSnapshot(f"snapshots of {peer} cannot be restored on this node: " + "; ".join(differences)
                                       + "; pull from a node with the same VMM setup, or create the snapshot here")
        chain = _chain_of(node, digest, peer)
        have = await asyncio.to_thread(self._held_prefix, chain)
        missing = chain[len(have):]
        top = missing[-1]
        tag = top.tag if await asyncio.to_thread(self._free, top.tag) else f"d-{digest[:12]}"
        query = urlencode({"have": ",".join(l.digest for l in have)}) if have else ""
        url = f"{source}/v1/node/chains/{digest}" + (f"?{query}" if query else "")
        progress(f"pulling {len(missing)} of {len(chain)} layers of {digest[:12]} from {peer} as {tag!r}")
        layers = sum(l.bytes for l in missing)
        limit = layers + PACK_OVERHEAD_BYTES
        # Briefly both the pack and its unpacked layers: refused before a byte is fetched when they do not fit.
        await asyncio.to_thread(self.packs.space.check, self.store.directory, limit + layers,
                                f"pulling {digest[:12]} from {peer}")
        work = self.store.build_dir("peer")
        try:
            pack = work / "chain.tar.zst"
            with self.packs.space.reported(work, f"pulling {digest[:12]} from {peer}"):
                size = await self._download(url, pack, limit, token, peer)
            try:
                manifest = await asyncio.to_thread(self.packs.inspect_file, pack)
            except PackError as exc:
                raise PeerError(f"{peer} sent no valid pack: {exc}") from None
            if manifest.top.digest != digest or manifest.snapshots[0].digest != missing[0].digest:
                raise PeerError(f"{peer} sent another chain than the one asked for ({digest[:12]}…); refused")
            await _unpack_to_the_end(self.packs, pack, tag, progress, peer)
        finally:
            await remove_tree(work)
        return {"digest": digest, "tag": tag, "pulled_layers": len(missing), "bytes": size}

    async def _node(self, source: str, token: str | None) -> _PeerNode:
        peer = transfer.shown(source)
        try:
            async with transfer.fetch(f"{source}/v1/node", self.urls, _auth(token)) as response:
                body = await transfer.read_limited(response, MAX_NODE_ANSWER, f"{peer}'s /v1/node answer")
                status = response.status_code
        except httpx.HTTPError as exc:
            raise PeerError(f"cannot reach {peer}: {type(exc).__name__}: {exc}; check its address and that "
                            "its daemon listens on TCP") from None
        except PackError as exc:
            raise PeerError(str(exc)) from None
        if status != 200:
            raise PeerError(f"{peer} answered GET /v1/node with HTTP {status}"
                            + ("; check source_token" if status == 401 else ""))
        try:
            return _PeerNode.model_validate_json(body)
        except ValidationError as exc:
            raise PeerError(f"{peer}'s /v1/node answer is not a forkd node's: {exc.error_count()} problems") from None

    async def _download(self, url: str, pack: Path, limit: int, token: str | None, peer: str) -> int:
        try:
            async with transfer.fetch(url, self.urls, _auth(token)) as response:
                if response.status_code != 200:
                    raise PeerError(f"{peer} answered HTTP {response.status_code} for the chain")
                received = 0
                with open(pack, "xb") as out:
                    async for chunk in response.aiter_bytes(archive.CHUNK):
                        received += len(chunk)
                        if received > limit:
                            raise PeerError(f"{peer} sent more than the {limit} bytes its listing declares; refused")
                        out.write(chunk)
        except httpx.HTTPError as exc:
            raise PeerError(f"the transfer from {peer} broke off: {type(exc).__name__}: {exc}") from None
        return received

    def _held_prefix(self, chain: list[_Listed]) -> list[_Listed]:
        """The root-side layers this store holds under the same tag and digest (a layer's disk names its
        parent by tag, so only those can be built on)."""
        held = []
        for layer in chain[:-1]:
            record = self.store.settle_one(self.store.registry.get_snapshot(layer.tag))  # a pending digest: waited
            if record is None or record.status != "ready" or record_digest(record) != layer.digest:
                break
            held.append(layer)
        return held

    def _free(self, tag: str) -> bool:
        return self.store.registry.get_snapshot(tag) is None and self.store.held_for(tag) is None


async def _unpack_to_the_end(packs: PackService, pack: Path, tag: str, progress: Progress, peer: str) -> None:
    """Unpack (verify, publish all or nothing); a cancelled caller waits for it: it runs on a thread that
    cannot be stopped midway, and its build directory goes only when it is done."""
    unpacking = asyncio.ensure_future(packs.unpack_file(pack, tag, False, progress))
    try:
        await asyncio.shield(unpacking)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await unpacking
        raise
    except PackError as exc:
        raise PeerError(f"the layers {peer} sent failed verification, nothing was registered: {exc}") from None


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _chain_of(node: _PeerNode, digest: str, peer: str) -> list[_Listed]:
    """The peer's chain ending at ``digest``, root first, from its listing."""
    by_digest = {s.digest: s for s in node.snapshots if s.status == "ready"}
    if digest not in by_digest:
        raise PeerSnapshotNotFound(f"{peer} (node {node.node_id}) holds no snapshot with digest {digest}; "
                                   "ask GET /v1/node of the nodes for the digests they hold")
    chain = [by_digest[digest]]
    while chain[-1].parent_digest is not None:
        parent = by_digest.get(chain[-1].parent_digest)
        if parent is None or len(chain) >= MAX_CHAIN_DEPTH:
            raise PeerError(f"{peer} lists the chain of {digest[:12]}… without its layer "
                            f"{chain[-1].parent_digest[:12]}… or deeper than {MAX_CHAIN_DEPTH}; refused")
        chain.append(parent)
    return chain[::-1]
