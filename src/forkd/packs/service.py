"""Packing, unpacking, pulling and pushing snapshots: the daemon side, which owns the store.

Unpacking is all or nothing: the tags are claimed in the store, the pack is extracted into a
store build directory and verified there (every digest, the chain and each link's record of its
parent's digests, the machine identity, every disk's backing reference, the store's own ancestors'
files); only then does the store publish the directories and register them, parent links
included, in one registry transaction, root first. On any failure the build directory is removed,
a replaced snapshot is put back, and nothing is registered. An unpack that replaces a snapshot
(``--force`` over a registered tag) runs inside the ``replacing`` hook the runtime hands in, which
empties that tag's pool of ready VMMs first and refills it afterwards: they hold the old snapshot.

Host paths and URLs come from API clients: with ``roots`` every pack file read or written (and a
pull's local file or index) must lie in the packs directory, and every network URL must pass the
daemon's ``UrlPolicy``, index entries and redirects included.

A pack is code (its device state is fed to the VMM), so a network pull must be pinned: by a SHA-256
the caller gives, or one an index read over https (or from a local file) lists. An unpinned pull is
refused unless the operator opted in (``[transfers] allow_unpinned``). Every job checks the free
space it needs above the floor first (``space.py``), and an unpack checks the manifest's declared
sizes against the snapshot's own meta (``bounds.py``) before a byte is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd.hostpaths import HostRoots
from forkd.packs import archive, transfer
from forkd.packs.bounds import check_declared_sizes
from forkd.packs.format import MAX_CHAIN_DEPTH, META_NAME, Manifest, PackError, layer_digest
from forkd.packs.index import entry_url, load_index
from forkd.packs.partials import remove_partials
from forkd.store.space import SpaceFloor
from forkd.store.errors import SnapshotConflict, SnapshotError
from forkd.store.io import long_job, remove_tree
from forkd.store.layout import BASE_DISK_FILE
from forkd.store.registry import SnapshotRecord
from forkd.store.snapshots import Claim, SnapshotStore
from forkd.validation import check_tag
from forkd.vmm.base import MachineIdentity

log = logging.getLogger("forkd.packs")
Progress = Callable[[str], None]
# Around an unpack that replaces the snapshot of a tag: what else holds that snapshot lets go of it.
Replacing = Callable[[str], AbstractAsyncContextManager[object]]
_REBUILD_HINT = "create the snapshot on this host with `forkd snapshot create` instead"


@dataclass
class UnpackPlan:
    """What unpacking a manifest does to the store, decided before a byte is extracted."""

    top_tag: str  # the tag the pack's top snapshot is registered as
    reuse: set[str] = field(default_factory=set)  # ancestors the store already holds with the same digest
    replaces: SnapshotRecord | None = None  # the snapshot --force replaces

    def final_tag(self, manifest: Manifest, pack_tag: str) -> str:
        return self.top_tag if pack_tag == manifest.top.tag else pack_tag


@dataclass(frozen=True)
class PullSource:
    url: str
    sha256: str | None
    size: int | None
    tag: str | None
    pinned: bool = True  # the SHA-256 (if any) came from the caller, an https index or a local index file


def unpacked_bytes(manifest: Manifest, reuse: set[str]) -> int:
    """What extracting ``manifest`` writes at most: each distinct file of the snapshots not reused
    once (identical files are hard links), at its declared size."""
    distinct = {(f.sha256, f.size) for s in manifest.snapshots if s.tag not in reuse for f in s.files}
    return sum(size for _, size in distinct)


def _allocated_bytes(chain: list[SnapshotRecord]) -> int:
    """The bytes a chain's files occupy on disk: a pack of them is at most about that (holes compress away)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for record in chain:
        for name in (META_NAME, *record.meta["sha256"]):
            info = (record.path / name).stat()
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512
    return total


class PackService:
    def __init__(self, store: SnapshotStore, live_children: Callable[[str], int], roots: HostRoots | None = None,
                 urls: transfer.UrlPolicy = transfer.UrlPolicy(), space: SpaceFloor | None = None,
                 allow_unpinned: bool = False,
                 replacing: Replacing = lambda _tag: contextlib.nullcontext()) -> None:
        self.store = store
        self.registry = store.registry
        self.live_children = live_children
        self.roots = roots  # None: any host path (in-process use only; the daemon always confines)
        self.urls = urls
        self.space = space or SpaceFloor(packs_dir=roots.packs if roots is not None else None)
        self.allow_unpinned = allow_unpinned  # pull from a network URL with no SHA-256 pin
        self._replacing = replacing
        self._lock = asyncio.Lock()  # one unpack at a time: two could plan against the same store

    def pack_input(self, path: Path, what: str = "pack") -> Path:
        """A pack file (or index) an API client named, confined to the packs directory."""
        return path if self.roots is None else self.roots.pack_input(path, what)

    def pack_output(self, path: Path) -> Path:
        return path if self.roots is None else self.roots.pack_output(path)

    def remove_partials(self) -> list[Path]:
        """At startup: remove the partial pack files a daemon killed mid-pack left in the packs directory."""
        removed = [] if self.roots is None else remove_partials(self.roots.packs)
        if removed:
            log.warning("removed %d partial pack files an interrupted pack left: %s", len(removed),
                        ", ".join(str(p) for p in removed))
        return removed

    # packing ---------------------------------------------------------------------------------------

    def chain(self, tag: str) -> list[SnapshotRecord]:
        """The ready snapshot ``tag`` and its ancestors, root first (the store's one chain walk)."""
        records = self.store.chain(tag)[::-1]
        if len(records) > MAX_CHAIN_DEPTH:
            raise SnapshotError(f"the chain of {tag!r} is deeper than {MAX_CHAIN_DEPTH}, the most a pack holds; "
                                f"compact it first with `forkd snapshot-compact {tag} NEW`")
        return records

    def settled_chain(self, tag: str) -> list[SnapshotRecord]:
        """:meth:`chain` once no link's digest is pending (blocking): a pack names its layers by digest."""
        chain = self.chain(tag)
        settled = self.store.settle(chain)
        if len(settled) != len(chain):
            raise SnapshotError(f"a snapshot of the chain of {tag!r} was removed, or failed, while its digest "
                                "was computed")
        return settled

    async def pack(self, tag: str, output: Path, force: bool, progress: Progress) -> dict[str, Any]:
        return await self._pack(tag, self.pack_output(output), force, progress)

    async def _pack(self, tag: str, output: Path, force: bool, progress: Progress) -> dict[str, Any]:
        archive.check_output(output, force)
        chain = await asyncio.to_thread(self.settled_chain, tag)
        progress(f"packing {' → '.join(r.tag for r in chain)}")
        started = time.monotonic()
        needed = await asyncio.to_thread(_allocated_bytes, chain)
        await asyncio.to_thread(self.space.check, output.parent, needed, f"a pack of {tag!r}")
        sources = [archive.SourceSnapshot(tag=r.tag, directory=r.path, image=r.image, created_at=r.created_at,
                                          parent_tag=r.parent_tag) for r in chain]
        with self.space.reported(output.parent, f"writing a pack of {tag!r}"):
            written = await long_job(archive.write_pack, output, sources, progress, force)
        return {"path": str(written.path), "size": written.size, "sha256": written.sha256,
                "seconds": round(time.monotonic() - started, 3), **archive.manifest_summary(written.manifest)}

    # unpacking -------------------------------------------------------------------------------------

    def check_target(self, tag: str, force: bool) -> SnapshotRecord | None:
        """Refuse a taken tag unless ``force``; returns the snapshot ``force`` would replace."""
        existing = self.registry.get_snapshot(check_tag(tag))
        if existing is None:
            return None
        if not force:
            raise SnapshotConflict(f"snapshot {tag!r} exists; unpack with --tag NEW, or --force to replace it")
        live = self.live_children(tag)
        if live:
            raise SnapshotConflict(f"snapshot {tag!r} has {live} live sandboxes; kill them before replacing it")
        dependents = self.registry.snapshot_children(tag)
        if dependents:
            raise SnapshotConflict(f"snapshot {tag!r} is the parent of {', '.join(dependents)}; "
                                   "it cannot be replaced under them")
        return existing

    def plan(self, manifest: Manifest, tag: str | None, force: bool) -> UnpackPlan:
        """Check a manifest against this host and store; raises before anything is extracted."""
        self.store.check_machine(manifest.machine_identity(), f"pack of {manifest.top.tag!r}", _REBUILD_HINT)
        plan = UnpackPlan(top_tag=check_tag(tag or manifest.top.tag))
        ancestors = manifest.snapshots[:-1]
        if plan.top_tag in {a.tag for a in ancestors}:
            raise PackError(f"tag {plan.top_tag!r} is an ancestor in this pack's chain; pick another --tag")
        root = manifest.snapshots[0]
        if root.parent_tag is not None:
            parent = self.registry.get_snapshot(root.parent_tag)
            parent = self.store.settle_one(parent)
            if parent is None:
                raise PackError(f"snapshot {root.tag!r} needs parent {root.parent_tag!r}, which is neither in the pack "
                                "nor in the store: pull or unpack the parent first")
            if layer_digest(parent.meta["sha256"]) != root.parent_digest:
                raise PackError(f"snapshot {root.tag!r} was made on another {root.parent_tag!r} than the store holds "
                                "(parent digest differs)")
        for ancestor in ancestors:
            existing = self.registry.get_snapshot(ancestor.tag)
            existing = self.store.settle_one(existing)
            if existing is None:
                continue
            if layer_digest(existing.meta["sha256"]) != ancestor.digest:
                raise SnapshotConflict(f"the pack's ancestor {ancestor.tag!r} differs from the store's snapshot of that "
                                       f"tag; remove the store's with `forkd rmi {ancestor.tag}` to unpack this chain")
            plan.reuse.add(ancestor.tag)
        plan.replaces = self.check_target(plan.top_tag, force)
        self.check_fits(manifest, plan.reuse)
        return plan

    def check_fits(self, manifest: Manifest, reuse: set[str]) -> None:
        """Refuse a manifest declaring sizes its snapshots' meta cannot hold, or more than the store's
        filesystem can take above the floor: before a byte is extracted (a zstd bomb writes nothing)."""
        root = manifest.snapshots[0]
        below = self.chain(root.parent_tag) if root.parent_tag is not None else []
        store_base_disk = max(((r.path / BASE_DISK_FILE).stat().st_size for r in below
                               if BASE_DISK_FILE in r.meta["sha256"]), default=None)
        check_declared_sizes(manifest, self.store.disk.file_name, store_base_disk)
        self.space.check(self.store.directory, unpacked_bytes(manifest, reuse), f"unpacking {manifest.top.tag!r}")

    def inspect(self, source: Path) -> Manifest:
        return self._manifest(self.pack_input(source))

    def inspect_file(self, source: Path) -> Manifest:
        """The manifest of a pack file the daemon wrote itself (a peer's chain in a build directory)."""
        return self._manifest(source)

    def _manifest(self, source: Path) -> Manifest:
        transfer.check_regular_file(source)
        try:
            return archive.read_manifest(source)
        except OSError as exc:
            raise PackError(f"cannot read pack {source}: {exc.strerror or exc}") from None

    def claim(self, manifest: Manifest, tag: str | None) -> Claim:
        """Hold every tag an unpack of ``manifest`` writes or reuses (409 if another request holds one);
        its ancestors may be in the store already (reused, so held against removal meanwhile)."""
        wanted = [tag or manifest.top.tag, *(s.tag for s in manifest.snapshots[:-1])]
        return self.store.claim(wanted, "unpacked", existing_ok=True)

    async def unpack(self, source: Path, tag: str | None, force: bool, progress: Progress,
                     claim: Claim | None = None) -> dict[str, Any]:
        """Unpack ``source`` (in the packs directory); ``claim`` when the caller already holds its tags."""
        return await self.unpack_file(self.pack_input(source), tag, force, progress, claim)

    async def unpack_file(self, source: Path, tag: str | None, force: bool, progress: Progress,
                          claim: Claim | None = None) -> dict[str, Any]:
        """Unpack a pack file the daemon fetched itself into a build directory (no host-path confinement)."""
        if claim is None:
            claim = self.claim(await asyncio.to_thread(self._manifest, source), tag)
        with claim:
            top = claim.tags[0]  # held: nobody else registers, replaces or removes it meanwhile
            replaces = force and await asyncio.to_thread(self.registry.get_snapshot, top) is not None
            async with self._lock, self._replacing(top) if replaces else contextlib.nullcontext():
                work = self.store.build_dir("unpack")
                try:
                    with self.space.reported(self.store.directory, "unpacking"):
                        return await long_job(self._unpack, claim, work, source, tag, force, progress)
                finally:
                    await remove_tree(work)

    def _unpack(self, claim: Claim, work: Path, source: Path, tag: str | None, force: bool,
                progress: Progress) -> dict[str, Any]:
        started = time.monotonic()
        decided: list[UnpackPlan] = []

        def plan_for(manifest: Manifest) -> archive.Plan:
            plan = self.plan(manifest, tag, force)
            decided.append(plan)
            targets = {s.tag: (self.store.directory / s.tag if s.tag in plan.reuse
                               else work / plan.final_tag(manifest, s.tag)) for s in manifest.snapshots}
            root = manifest.snapshots[0]
            below = self.chain(root.parent_tag) if root.parent_tag is not None else []
            for link in below:  # the store's ancestors the pack builds on: still what they were saved as
                self.store.verify(link)
            store_files = {r.tag: {META_NAME, *r.meta["sha256"]} for r in below}
            progress(f"unpacking {' → '.join(s.tag for s in manifest.snapshots)} as {plan.top_tag!r}"
                     + (f" (reusing {', '.join(sorted(plan.reuse))} from the store)" if plan.reuse else ""))
            return archive.Plan(targets=targets, reuse=plan.reuse, store_files=store_files)

        manifest, metas = archive.extract_pack(source, plan_for, progress, self.store.disk)
        records = self._publish(claim, manifest, decided[0], metas, work)
        top = records[-1]  # the top snapshot is never reused, so always published
        return {**top.to_dict(), "unpacked": [r.tag for r in records], "reused": sorted(decided[0].reuse),
                "seconds": round(time.monotonic() - started, 3)}

    def _publish(self, claim: Claim, manifest: Manifest, plan: UnpackPlan, metas: dict[str, dict[str, Any]],
                 work: Path) -> list[SnapshotRecord]:
        """Publish the verified directories through the store, each registered with its parent link."""
        entries: list[tuple[Path, SnapshotRecord]] = []
        for entry in manifest.snapshots:
            if entry.tag in plan.reuse:
                continue
            final_tag = plan.final_tag(manifest, entry.tag)
            entries.append((work / final_tag, SnapshotRecord(
                tag=final_tag, status="ready", image=entry.image, path=self.store.directory / final_tag,
                created_at=time.time(), meta=metas[entry.tag], parent_tag=entry.parent_tag)))
        for _, record in entries:
            self._check_parent_digests(record, metas)
            self.store.check_format(record.meta, f"snapshot {record.tag!r} of the pack", "recreate it on this host")
        replacing = (plan.replaces, work / ".replaced") if plan.replaces is not None else None
        self.store.publish(claim, entries, replacing=replacing)
        for _, record in entries:  # every file was just hashed as it was written: the first fork need not again
            for name, digest in record.meta["sha256"].items():
                self.store.digests.remember(record.path / name, digest)
        return [record for _, record in entries]

    def _check_parent_digests(self, record: SnapshotRecord, metas: dict[str, dict[str, Any]]) -> None:
        """A link must record its parent's digests as the parent (from the pack or the store) has them."""
        if record.parent_tag is None:
            return
        parent_meta = metas.get(record.parent_tag)
        if parent_meta is None:
            parent_meta = self.store.get(record.parent_tag).meta
        parent = SnapshotRecord(tag=record.parent_tag, status="ready", image="", path=Path(), created_at=0,
                                meta=parent_meta)
        if record.meta.get("parent_sha256") != self.store.parent_digests(parent):
            raise PackError(f"snapshot {record.tag!r} records other digests for its parent {record.parent_tag!r} "
                            "than the parent has: the pack is inconsistent")

    # pull and push ---------------------------------------------------------------------------------

    async def resolve(self, url: str | None, index: str | None, name: str | None, sha256: str | None,
                      tag: str | None) -> PullSource:
        """Where to download from; with an index, refuses a pack for another machine before downloading.

        A network pull must be pinned (see the module's docstring); an unpinned one is refused here,
        before anything is fetched, unless the daemon allows it."""
        if index is None:
            if url is None:
                raise PackError("give a pack URL, or --index and a pack name")
            checked = self._source(url)
            pinned = sha256 is not None or transfer.local_path(checked) is not None
            self._check_pinned(checked, pinned)
            return PullSource(url=checked, sha256=sha256, size=None, tag=tag, pinned=pinned)
        if name is None:
            raise PackError("give the name of a pack in the index")
        location = self._source(index, "index")
        pinned = transfer.local_path(location) is not None or location.lower().startswith("https://")
        self._check_pinned(location, pinned)
        listed, base = await load_index(location, self.urls)
        entry = listed.find(name)
        self.store.check_machine(MachineIdentity.from_dict(entry.identity), f"pack {name!r}", _REBUILD_HINT)
        return PullSource(url=self._source(entry_url(entry, base)), sha256=entry.sha256, size=entry.size,
                          tag=tag or entry.tag, pinned=pinned)

    def _check_pinned(self, url: str, pinned: bool) -> None:
        if pinned or self.allow_unpinned:
            return
        raise PackError(
            f"refusing to pull {transfer.shown(url)} without a SHA-256 pin: a pack is code (its device state is fed "
            "to the VMM), so a network pull must name the digest its publisher gave. Pass --sha256 HEX (the "
            "publisher's `sha256sum` of the pack file), or pull by name from an https:// index that lists it "
            "(`forkd pull NAME --index https://...`); an operator who accepts unpinned pulls sets "
            "`[transfers] allow_unpinned = true` in the daemon's config")

    def _source(self, url: str, what: str = "pack") -> str:
        """A pull source as given, if it is an allowed http(s) URL or a file in the packs directory."""
        local = transfer.local_path(url)
        if local is None:
            return self.urls.check(url)
        checked = self.pack_input(local, what)
        return url if checked == local else checked.as_uri()

    async def pull(self, source: PullSource, force: bool, progress: Progress) -> dict[str, Any]:
        if source.tag is not None:
            self.check_target(source.tag, force)  # before a long download, not after it
        local = transfer.local_path(source.url)
        if local is not None:
            local = self.pack_input(local)
        work = self.store.build_dir("pull")
        try:
            if not source.pinned:
                progress("no SHA-256 pin (allowed by `[transfers] allow_unpinned`): only the pack's own manifest "
                         "digests protect this download, and they come with it")
            if local is not None:
                progress(f"checking {local}")
                digest = await long_job(transfer.check_advertised, local, source.sha256, source.size, progress)
                pack = local
            else:
                progress(f"downloading {transfer.shown(source.url)}")
                pack = work / "pack.tar.zst"
                what = f"the download of {transfer.shown(source.url)}"
                await asyncio.to_thread(self.space.check, work, source.size or 0, what)
                with self.space.reported(work, what):
                    digest = await transfer.download(source.url, pack, source.sha256, source.size, progress,
                                                     self.urls, self.space.watch(work, what))
            progress(f"pack SHA-256 {digest}" + (" matches the advertised digest" if source.sha256 else ""))
            result = await self.unpack_file(pack, source.tag, force, progress)
        finally:
            await remove_tree(work)
        return {**result, "pack_sha256": digest}

    def check_push_url(self, url: str) -> None:
        if transfer.local_path(url) is not None:
            raise PackError("push uploads to an http(s) URL (e.g. a presigned PUT URL); use `forkd pack` for files")
        self.urls.check(url)

    async def push(self, tag: str, url: str, progress: Progress) -> dict[str, Any]:
        self.check_push_url(url)
        work = self.store.build_dir("push")
        try:
            packed = await self._pack(tag, work / f"{tag}.tar.zst", False, progress)
            progress(f"uploading {packed['size'] / 2**20:.1f} MiB to {transfer.shown(url)}")
            await transfer.upload(Path(packed["path"]), url, progress, self.urls)
        finally:
            await remove_tree(work)
        return {**packed, "path": None, "url": transfer.shown(url)}
