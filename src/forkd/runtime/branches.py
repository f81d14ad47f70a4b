"""BRANCH: save a running sandbox as a new snapshot while it keeps running.

The sandbox is paused only while the backend captures it (disk switched to a new overlay, device
state written, the guest RAM pages it holds privately copied out); everything else (the disk
layer, the memory layer or flattened memory file, digests, publishing) happens after it runs
again. The new snapshot's parent is the sandbox's *head*: the snapshot it was forked from, or the
one it was last branched to — the one its disk and memory now derive from. Every stage is timed
(``runtime/timings.py``): the answer's ``timings`` and the ``forkd_branch_stage_seconds`` histogram.

The snapshot is registered as ``writing`` before the pause, so it is visible (and refused to fork,
409) while it is built; it becomes ``ready`` or ``failed``. A caller that does not wait gets it back
right after the pause (``wait=False``): what it does in the sandbox from then on is not in the
snapshot. Captures of one sandbox follow each other without waiting for the layers before them to
be written: each chains onto the one captured before it, and its layer is written once that
parent's is (it compares its pages against the parent's memory). That record, naming its source
(``meta.source_sandbox``), is also how a restarted daemon knows a stopped source was stopped by
this pause and resumes it instead of reaping it (``runtime/recovery.py``).

Chains are bounded here, the one place a layer is added to one: a branch whose parent already has
``max_chain_depth`` ancestors is written standalone (whole memory, disk flattened onto the root's
base image, no parent: ``runtime/compact.py``), so a client that snapshots a sandbox, or a child of
a child, in a loop never makes a chain deeper than the bound. It is one publish like any other
branch (nothing existing is rewritten); the layers below it stay while anything else needs them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.guest import protocol
from forkd.runtime.compact import CompactService
from forkd.runtime.metrics import Metrics
from forkd.runtime.sandboxes import LiveSandbox, SandboxService
from forkd.runtime.spawning import Spawner
from forkd.runtime.timings import Timings
from forkd.store import layers as memory_layers
from forkd.store.chains import ChainMemory, chain_memory, registered_ancestors
from forkd.store.errors import SnapshotConflict, SnapshotError
from forkd.store.io import blocking, remove_tree
from forkd.store.layout import (
    INHERITED_META,
    INITRD_FILE,
    KERNEL_FILE,
    LAYER_FILE,
    MEMORY_FILE,
    STATE_FILE,
    baked_files,
    branch_files,
)
from forkd.store.pending import pending_files
from forkd.store.registry import Registry, SnapshotRecord
from forkd.store.snapshots import Claim, SnapshotStore
from forkd.store.space import SpaceFloor
from forkd.vmm.base import Pages, Vmm
from forkd.vmm.branching import Capture, branching_of

MODES = ("full", "diff", "live")
REFUSED = "branch_refused"  # sandbox meta: why it may not be branched again (kept across restarts)
STDERR_TAIL_BYTES = 4096  # of a diff command's stderr, for the error message when it fails


class BranchBusy(SnapshotError):
    """Too many branches are being written at once; try again shortly."""

    kind = "busy"


@dataclass
class _SourceState:
    """Per-sandbox branch bookkeeping: one capture at a time, and where its disk chain stands."""

    lock: asyncio.Lock  # held for a capture only; the layers are written after it is released
    broken: str | None = None  # set when its disk holds a layer no snapshot received (meta.branch_refused)
    head: str | None = None  # captured last, maybe still being written: what the next capture chains onto
    writing: asyncio.Task[SnapshotRecord] | None = None  # the build of ``head``, until it is published

    def busy(self) -> bool:
        return self.lock.locked() or (self.writing is not None and not self.writing.done())


class BranchService:
    def __init__(self, paths: Paths, store: SnapshotStore, vmm: Vmm, sandboxes: SandboxService, spawner: Spawner,
                 max_concurrent: int, metrics: Metrics, space: SpaceFloor, compaction: CompactService,
                 max_chain_depth: int) -> None:
        self.paths = paths
        self.space = space  # a branch writes its memory and disk layers under paths.snapshots
        self.metrics = metrics
        self.store = store
        self.registry: Registry = store.registry
        self.vmm = vmm
        self.sandboxes = sandboxes
        self.spawner = spawner  # diff_exec forks the child it runs its command in
        self.max_concurrent = max_concurrent
        self.compaction = compaction  # writes a branch standalone when its chain would pass the bound
        self.max_chain_depth = max_chain_depth  # ancestors a branch may have; one more: written standalone
        self._builds: dict[str, asyncio.Task[SnapshotRecord]] = {}  # builds under way, by tag (claimed in the store)
        self._sources: dict[str, _SourceState] = {}

    async def refuse(self, sandbox_id: str, reason: str) -> None:
        """Never branch ``sandbox_id`` again: its disk may hold a layer no snapshot received (``reason``)."""
        await self._refuse(self.sandboxes.get(sandbox_id), reason)

    async def _refuse(self, live: LiveSandbox, reason: str) -> None:
        """A branch would chain onto a head that lacks part of the sandbox's disk: refuse it from now on,
        in its record too, so a restarted daemon refuses it as well."""
        self._source(live).broken = live.record.meta[REFUSED] = reason
        await asyncio.to_thread(self.registry.set_branch_refused, live.record.id, reason)

    def _source(self, live: LiveSandbox) -> _SourceState:
        return self._sources.setdefault(live.record.id, _SourceState(lock=asyncio.Lock(),
                                                                     broken=live.record.meta.get(REFUSED)))

    async def branch(self, sandbox_id: str, tag: str, mode: str = "diff", wait: bool = True,
                     claim: Claim | None = None, meta: dict[str, str] | None = None) -> SnapshotRecord:
        """Register ``tag`` as writing, then build it; with ``wait`` return it ready, else (still
        ``writing``) once the sandbox was captured and runs again.

        ``claim``: the tag, when the caller already holds it; it is released when the build ends.
        ``meta``: what a front records with the snapshot (the E2B front: the E2B id it was taken of).
        """
        if mode not in MODES:
            raise SnapshotError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        branching_of(self.vmm)  # a backend without the capability is refused before anything is claimed
        claim = claim or self.store.claim(tag, "branched")  # before any await: the first request takes the tag
        try:
            await asyncio.to_thread(self.space.check, self.paths.snapshots, 0, f"branching {sandbox_id} to {tag!r}")
            live = self.sandboxes.get(sandbox_id)
            if len(self._builds) >= self.max_concurrent:
                raise BranchBusy(f"{len(self._builds)} branches are being written (the limit is "
                                 f"{self.max_concurrent}, config limits.max_branches); retry when one is ready")
            running = {s.record.id for s in self.sandboxes.live()}
            for gone in [sid for sid, state in self._sources.items()
                         if sid not in running and not state.busy()]:
                del self._sources[gone]  # bookkeeping of sandboxes that have exited
            source = self._source(live)
            if source.broken:
                raise SnapshotConflict(f"sandbox {sandbox_id} cannot be branched again: {source.broken}")
        except BaseException:
            claim.release()
            raise
        tag = claim.tags[0]
        # Without a layer to chain onto, the snapshot the sandbox was forked from, flattened over: its
        # parent while it is written (so it cannot be removed meanwhile), none once published.
        parent_tag = self._chains_onto(live, source, tag) or live.record.snapshot_tag
        parent = self.registry.get_snapshot(parent_tag)
        record = SnapshotRecord(tag=tag, status="writing", image=parent.image if parent else "",
                                path=self.paths.snapshots / tag, created_at=time.time(),
                                meta={**(meta or {}), "mode": mode, "source_sandbox": sandbox_id}, parent_tag=parent_tag)
        try:
            await asyncio.to_thread(self.store.register_writing, claim, record)
        except BaseException:
            claim.release()
            raise
        captured: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._build(live, source, record, mode, claim, meta or {}, captured))
        self._builds[tag] = task
        task.add_done_callback(lambda done: self._finished(tag, done))
        if wait:
            return await asyncio.shield(task)  # a client that goes away does not abandon the build
        # Back once the sandbox runs again (a failed capture raises here); neither wait cancels the build.
        await asyncio.wait((captured, task), return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else record

    def _finished(self, tag: str, task: asyncio.Task[SnapshotRecord]) -> None:
        self._builds.pop(tag, None)
        if task.cancelled() or task.exception() is not None:
            return  # a failure is recorded as the snapshot's status and error
        meta = task.result().meta
        self.metrics.branch_seconds.labels(meta["mode"]).observe(meta["total_seconds"])
        self.metrics.branch_pause_seconds.labels(meta["mode"]).observe(meta["pause_ms"] / 1000)

    async def _build(self, live: LiveSandbox, source: _SourceState, record: SnapshotRecord, mode: str,
                     claim: Claim, front_meta: dict[str, str], captured: asyncio.Future[None]) -> SnapshotRecord:
        build_dir: Path | None = None
        backend_state: dict[str, Any] | None = None  # the source's before its capture
        try:
            build_dir = self.store.build_dir(record.tag)
            async with source.lock:  # one capture of a sandbox at a time, in order
                if source.broken:
                    raise SnapshotConflict(f"sandbox {live.record.id} cannot be branched again: {source.broken}")
                # The head may have moved (or been removed) while this branch waited for the one before it.
                onto = self._chains_onto(live, source, record.tag)
                record.parent_tag = onto or live.record.snapshot_tag
                before = source.writing if onto not in (None, live.record.head) else None
                await asyncio.to_thread(self.registry.update_snapshot, record.tag, status="writing",
                                        parent_tag=record.parent_tag)
                standalone = onto is None or await asyncio.to_thread(self.too_deep, onto)
                # Every layer of its chain has the memory size of the snapshot it was forked from.
                ready = self.registry.get_snapshot(live.record.snapshot_tag)
                if ready is None or ready.status != "ready":
                    raise SnapshotError(f"the sandbox's snapshot {live.record.snapshot_tag!r} is not ready")
                timings = Timings()
                backend_state = dict(live.vm.state)
                async with self.sandboxes.idle.awake(live.record.id):  # continued if idle-stopped
                    capture = await branching_of(self.vmm).capture(
                        live.vm, ready.meta["identity"]["memory_mib"] << 20, build_dir / STATE_FILE,
                        live=mode == "live", mark=timings.mark)
                # A restarted daemon adopts the new top.
                await asyncio.to_thread(self.registry.set_vmm_state, live.record.id, live.vm.state)
                source.head, source.writing = record.tag, asyncio.current_task()  # type: ignore[assignment]
            # The frozen disk lies in the source's run directory: taken before the answer, so a source
            # killed right after it does not take its disk layer along.
            disk = self.vmm.disk.file_name
            # Without a layer to chain onto it takes in the source's earlier layers, to be flattened below.
            backing = None if onto is None else f"../{record.parent_tag}/{disk}"
            await self.vmm.disk.export_layer(capture.frozen_disk, build_dir / disk, backing)
            timings.mark("disk_layer_written")
            record.meta = {**record.meta, "pause_ms": round(capture.pause_s * 1000, 2)}
            captured.set_result(None)
            if before is not None:  # its parent was captured before it and is still being written
                await asyncio.wait((before,))
                timings.mark("parent_written")
            parent = self.registry.get_snapshot(record.parent_tag)
            if parent is not None and parent.status == "ready" and pending_files(parent.meta):
                parent = await self.store.pending.settled(parent.tag)  # this one records its parent's digests
                timings.mark("parent_digest")
            if parent is None or parent.status != "ready":
                raise SnapshotError(f"the sandbox's parent snapshot {record.parent_tag!r} was not written")
            chain = self.store.ancestry(parent)
            meta = {**front_meta, "source_sandbox": live.record.id,  # whose chain a next branch of it goes on
                    **await self._assemble(build_dir, chain, capture, mode, timings, standalone)}
            if standalone:
                record.parent_tag = None  # published without a parent: the chain ends here
            meta["pause_ms"] = record.meta["pause_ms"]
            meta["timings"] = timings.as_ms()  # meta.json keeps them up to `sealed`
            record.meta = self.store.write_meta(build_dir, meta)
            # The sandbox's head moves in the same transaction: its disk now derives from this layer.
            await blocking(self.store.publish, claim, [(build_dir, record)], head_of=live.record.id)
            live.record.branch_head = record.tag
            timings.mark("published")
            # The answer (not meta.json, written before) also says what publishing took.
            record.meta = {**record.meta, "timings": timings.as_ms(), "total_seconds": round(timings.total, 3)}
            timings.observe(self.metrics.branch_stage_seconds, mode)
        except BaseException as exc:
            if backend_state is not None and live.vm.state != backend_state:  # the source writes a new disk top: its old one is in no snapshot
                await self._refuse(live, f"its branch to {record.tag!r} failed after its disk was switched ({exc})")
            await asyncio.to_thread(self.store.mark_failed, record.tag, str(exc) or type(exc).__name__)
            raise
        finally:
            claim.release()
            if build_dir is not None:
                await remove_tree(build_dir)
        return record

    def _chains_onto(self, live: LiveSandbox, source: _SourceState, tag: str) -> str | None:
        """The snapshot a branch ``tag`` of ``live`` chains onto: the one captured last (maybe still being
        written), or None once that was removed (``rmi``; its tag maybe taken since by another snapshot or
        by this branch) or failed: the branch is then written standalone over the snapshot the sandbox
        was forked from, whose memory its private pages are laid over."""
        head = source.head or live.record.head
        if head == live.record.snapshot_tag:
            return head  # kept while the sandbox lives
        record = self.registry.get_snapshot(head)
        # Only a layer this sandbox wrote, written or being written (a layer published before branches
        # recorded their source is not told apart from another one of that tag: it costs one standalone).
        usable = (record is not None and record.meta.get("source_sandbox") == live.record.id
                  and record.status in ("ready", "writing"))
        return head if usable and head != tag else None

    def too_deep(self, parent_tag: str) -> bool:
        """Whether a branch of ``parent_tag`` would pass ``max_chain_depth``: it is then written standalone."""
        parent = self.registry.get_snapshot(parent_tag)
        return parent is not None and len(registered_ancestors(self.registry, parent)) >= self.max_chain_depth

    async def _assemble(self, build_dir: Path, chain: list[SnapshotRecord], capture: Capture,
                        mode: str, timings: Timings, standalone: bool) -> dict[str, Any]:
        """Memory (a layer, or flattened whole) of the new snapshot next to its disk layer, then its meta;
        ``standalone``: whole memory and a flattened disk, with no parent (the chain's bound).

        All of it runs after the source was resumed: the capture holds what the pause took.
        """
        parent = chain[0]
        for name in (KERNEL_FILE, INITRD_FILE):
            await blocking(self.store.digests.link, parent.path / name, build_dir / name)
        disk = self.vmm.disk.file_name
        memory = chain_memory(chain)
        if standalone:
            flat = await self.compaction.flatten_into(build_dir, chain, await blocking(_read_chain, memory),
                                                      capture.pages)
            memory_kind, changed, written = "full", flat.changed_pages, {MEMORY_FILE: flat.sha256}
        else:
            memory_kind = "diff" if mode == "diff" else "full"
            changed, written = await blocking(_write_memory, build_dir, memory, capture.pages, memory_kind)
        deferred = [MEMORY_FILE] if not standalone and memory_kind == "full" else []  # hashed after publishing
        timings.mark("layer_written")
        meta = {
            **{k: parent.meta[k] for k in INHERITED_META if k in parent.meta},
            "mode": mode,
            "memory_kind": memory_kind,
            "state_format": capture.state_format,
            "private_pages": len(capture.pages.offsets),
            "changed_pages": changed,
        }
        if standalone:
            meta["compacted_chain"] = [link.tag for link in chain]  # what it was flattened over
        else:
            meta["parent_sha256"] = self.store.parent_digests(parent)
        if mode == "live":
            meta["precopied"] = capture.precopied
        names = baked_files(disk) if standalone else branch_files(disk, meta)
        meta["sha256"] = await blocking(self.store.seal, build_dir, names, written, deferred)
        meta["sizes"] = {name: (build_dir / name).stat().st_size for name in names}
        timings.mark("sealed")
        return meta

    async def diff_exec(self, base_tag: str, tag: str, command: str, timeout_s: float) -> SnapshotRecord:
        """Fork a child of ``base_tag``, run ``command`` in it, branch it as diff layer ``tag``, kill it."""
        claim = self.store.claim(tag, "branched")  # held from before the fork until the layer is published
        try:
            [outcome] = await self.spawner.fork(base_tag, 1)
        except BaseException:
            claim.release()
            raise
        if outcome.sandbox is None:
            claim.release()
            raise SnapshotError(f"could not fork {base_tag!r} to run the command: {outcome.error}")
        sandbox_id = outcome.sandbox["id"]
        branching = False
        try:
            stderr = bytearray()  # only its tail is kept: the guest decides how much it prints

            def on_event(name: str, data: dict[str, Any]) -> None:
                if name == protocol.EVENT_STDERR:
                    stderr.extend(protocol.b64decode(str(data.get("data_b64", ""))))
                    del stderr[:-STDERR_TAIL_BYTES]

            result = await self.sandboxes.get(sandbox_id).agent.call(
                protocol.OP_EXEC, {"shell": command, "timeout_s": timeout_s}, timeout=timeout_s + 30,
                on_event=on_event)
            if result.get("exit_code") != 0:
                raise SnapshotError(f"the command exited with {result.get('exit_code')} "
                                    f"(signal {result.get('signal')}), so no layer was saved: "
                                    f"{stderr.decode(errors='replace')[-500:].strip()}")
            branching = True  # from here on the branch owns (and releases) the claim
            return await self.branch(sandbox_id, tag, mode="diff", wait=True, claim=claim)
        finally:
            if not branching:
                claim.release()
            await self.sandboxes.kill(sandbox_id)

    async def wait_all(self) -> None:
        """Let branches being written finish (or fail) before the daemon stops their sources."""
        await asyncio.gather(*self._builds.values(), return_exceptions=True)


def _write_memory(build_dir: Path, memory: ChainMemory, captured: Pages, kind: str) -> tuple[int, dict[str, str]]:
    """The snapshot's own memory from the captured private pages: how many pages differ from the
    parent's, and the digests of the files written, where they were computed while writing.

    The source's memory is the file it was restored from plus its private pages, and a page once
    private stays private; its head (``memory``, the parent) is that same file plus the private
    pages it had then. So outside the captured pages both agree, and of the captured pages those
    equal to the parent's image are dropped (a child of a diff snapshot holds its chain's layers
    privately too: they were laid in at restore). ``full`` lays the captured pages over the parent's
    memory into one sparse file, so it needs no parent memory; its digest is computed after
    publishing (``forkd.store.pending``: ``pending`` until then).
    """
    parent = _read_chain(memory)
    if kind == "full":  # not hashed here: SHA-256 of all guest RAM was most of a full BRANCH (store/pending.py)
        flat = memory_layers.flatten(parent, build_dir / MEMORY_FILE, top=captured, digest=False)
        return flat.changed_pages, {}
    layer = memory_layers.write_layer(build_dir / LAYER_FILE, captured, parent)
    return len(layer.offsets), {LAYER_FILE: layer.sha256}


def _read_chain(memory: ChainMemory) -> memory_layers.ChainMemory:
    """The chain's memory as its children see it (its layers read: blocking)."""
    return memory_layers.ChainMemory(memory.base, [memory_layers.read_layer(p) for p in memory.layers])
