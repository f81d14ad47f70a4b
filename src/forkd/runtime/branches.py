"""BRANCH: save a running sandbox as a new snapshot while it keeps running.

The sandbox is paused only for the capture (disk frozen, RAM and devices streamed); it then goes on
writing a new qcow2 overlay. The capture is turned into an ordinary snapshot by a short-lived
re-parent VMM (``full``), or further reduced to the pages that differ from the parent snapshot's
memory (``diff``). The new snapshot's parent is the sandbox's *head*: the snapshot it was forked
from, or the one it was last branched to — the one its disk and memory now derive from.

The snapshot is registered as ``writing`` before the pause, so it is visible (and refused to fork,
409) while it is built; it becomes ``ready`` or ``failed``.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.guest import protocol
from forkd.runtime.chains import (
    DISK_FILE,
    LAYER_FILE,
    MEMORY_FILE,
    ancestry,
    chain_memory,
    memory_layer_name,
    parent_digests,
)
from forkd.runtime.metrics import Metrics
from forkd.runtime.registry import Registry, SnapshotRecord
from forkd.runtime.sandboxes import LiveSandbox, SandboxService
from forkd.runtime.snapshots import (
    INITRD_FILE,
    KERNEL_FILE,
    META_FILE,
    STATE_FILE,
    SnapshotConflict,
    SnapshotError,
    SnapshotService,
    boot_spec,
    seal_files,
)
from forkd.store import layers as memory_layers
from forkd.store.files import link_or_copy, write_json_atomic
from forkd.validation import check_tag
from forkd.vmm.base import Vmm
from forkd.vmm.branching import branching_of

MODES = ("full", "diff", "live")
class BranchBusy(SnapshotError):
    """Too many branches are being written at once; try again shortly."""


@dataclass
class _SourceState:
    """Per-sandbox branch bookkeeping: one capture at a time, and where its disk chain stands."""

    lock: asyncio.Lock
    broken: str | None = None  # set when a capture froze a disk layer no snapshot received


class BranchService:
    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, snapshots: SnapshotService,
                 sandboxes: SandboxService, max_concurrent: int, metrics: Metrics) -> None:
        self.paths = paths
        self.metrics = metrics
        self.registry = registry
        self.vmm = vmm
        self.snapshots = snapshots
        self.sandboxes = sandboxes
        self.max_concurrent = max_concurrent
        self._writing: dict[str, asyncio.Task[SnapshotRecord]] = {}
        self._sources: dict[str, _SourceState] = {}

    async def branch(self, sandbox_id: str, tag: str, mode: str = "diff", wait: bool = True) -> SnapshotRecord:
        """Register ``tag`` as writing, then build it; with ``wait`` return it ready, else at once."""
        tag = check_tag(tag)
        if mode not in MODES:
            raise SnapshotError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        branching_of(self.vmm)  # a backend without the capability is refused before anything is registered
        live = self.sandboxes.get(sandbox_id)
        if self.registry.get_snapshot(tag) is not None or tag in self._writing:
            raise SnapshotConflict(f"snapshot {tag!r} exists or is being written; pick another tag "
                                   f"or remove it with `forkd rmi {tag}`")
        if len(self._writing) >= self.max_concurrent:
            raise BranchBusy(f"{len(self._writing)} branches are being written (the limit is "
                             f"{self.max_concurrent}, config limits.max_branches); retry when one is ready")
        running = {s.record.id for s in self.sandboxes.live()}
        for gone in [sid for sid, state in self._sources.items() if sid not in running and not state.lock.locked()]:
            del self._sources[gone]  # bookkeeping of sandboxes that have exited
        source = self._sources.setdefault(sandbox_id, _SourceState(lock=asyncio.Lock()))
        if source.broken:
            raise SnapshotConflict(f"sandbox {sandbox_id} cannot be branched again: {source.broken}")
        parent_tag = live.record.meta.get("branch_head", live.record.snapshot_tag)
        parent = self.registry.get_snapshot(parent_tag)
        record = SnapshotRecord(tag=tag, status="writing", image=parent.image if parent else "",
                                path=self.paths.snapshots / tag, created_at=time.time(),
                                meta={"mode": mode, "source_sandbox": sandbox_id}, parent_tag=parent_tag)
        self.registry.add_snapshot(record)
        task = asyncio.create_task(self._build(live, source, record, mode))
        self._writing[tag] = task
        task.add_done_callback(lambda done: self._finished(tag, done))
        if not wait:
            return record
        return await asyncio.shield(task)  # a client that goes away does not abandon the build

    def _finished(self, tag: str, task: asyncio.Task[SnapshotRecord]) -> None:
        self._writing.pop(tag, None)
        if task.cancelled() or task.exception() is not None:
            return  # a failure is recorded as the snapshot's status and error
        meta = task.result().meta
        self.metrics.branch_seconds.labels(meta["mode"]).observe(meta["total_seconds"])
        self.metrics.branch_pause_seconds.labels(meta["mode"]).observe(meta["pause_ms"] / 1000)

    async def _build(self, live: LiveSandbox, source: _SourceState, record: SnapshotRecord,
                     mode: str) -> SnapshotRecord:
        build_dir = self.paths.snapshots / f".build-{record.tag}-{secrets.token_hex(4)}"
        captured = False
        try:
            async with source.lock:  # one capture of a sandbox at a time, in order
                if source.broken:
                    raise SnapshotConflict(f"sandbox {live.record.id} cannot be branched again: {source.broken}")
                # The head may have moved while this branch waited for the one before it.
                record.parent_tag = live.record.meta.get("branch_head", live.record.snapshot_tag)
                self.registry.update_snapshot(record.tag, status="writing", parent_tag=record.parent_tag)
                parent = self.registry.get_snapshot(record.parent_tag)
                if parent is None or parent.status != "ready":
                    raise SnapshotError(f"the sandbox's parent snapshot {record.parent_tag!r} is not ready")
                parent_chain = ancestry(self.registry, parent)
                build_dir.mkdir(parents=True)
                started = time.monotonic()
                top = live.vm.run_dir / f"disk-{secrets.token_hex(4)}.qcow2"
                stream = build_dir / ".capture"
                capture = await branching_of(self.vmm).capture(live.vm, top, stream, live=mode == "live")
                captured = True
                self.registry.set_vmm_state(live.record.id, live.vm.state)  # a restarted daemon adopts the new top
                captured_s = time.monotonic() - started
                meta = await self._assemble(build_dir, parent, parent_chain, capture.frozen_disk, stream, mode)
                meta.update({
                    "pause_ms": round(capture.pause_s * 1000, 2),
                    "capture_seconds": round(captured_s, 3),
                    "total_seconds": round(time.monotonic() - started, 3),
                    "captured_bytes_stream": meta.pop("_stream_bytes"),
                })
                write_json_atomic(build_dir / META_FILE, meta)
                record.meta = meta
                self.snapshots.publish(build_dir, record, registered=True)
                live.record.meta["branch_head"] = record.tag
                self.registry.update_sandbox(live.record.id, meta={"branch_head": record.tag})
        except BaseException as exc:
            if captured:
                source.broken = f"its branch to {record.tag!r} failed after its disk was frozen ({exc})"
            self.registry.update_snapshot(record.tag, status="failed",
                                          meta={**record.meta, "error": str(exc) or type(exc).__name__})
            raise
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
        return record

    async def _assemble(self, build_dir: Path, parent: SnapshotRecord, parent_chain: list[SnapshotRecord],
                        frozen_disk: Path, stream: Path, mode: str) -> dict[str, Any]:
        """Disk layer, device state and memory (whole or diff) of the new snapshot, then its meta."""
        for name in (KERNEL_FILE, INITRD_FILE):
            link_or_copy(parent.path / name, build_dir / name)
        await branching_of(self.vmm).export_disk_layer(frozen_disk, build_dir / DISK_FILE, f"../{parent.tag}/{DISK_FILE}")
        timings: dict[str, float] = {}
        started = time.monotonic()
        spec = boot_spec(build_dir, parent.meta)
        await branching_of(self.vmm).reparent(spec, stream, build_dir / DISK_FILE, build_dir / MEMORY_FILE,
                                build_dir / STATE_FILE, build_dir / ".reparent")
        timings["reparent_seconds"] = round(time.monotonic() - started, 3)
        stream_bytes = stream.stat().st_size
        stream.unlink()
        memory_kind = "diff" if mode == "diff" else "full"
        pages = None
        if memory_kind == "full":
            await asyncio.to_thread(memory_layers.punch_zero_pages, build_dir / MEMORY_FILE)
        else:
            started = time.monotonic()
            pages = await asyncio.to_thread(self._diff_memory, build_dir, parent_chain)
            timings["diff_seconds"] = round(time.monotonic() - started, 3)
        meta = {
            **{k: parent.meta[k] for k in ("identity", "boot", "image_key", "warm_modules", "warmup_cmd")
               if k in parent.meta},
            "mode": mode,
            "memory_kind": memory_kind,
            "parent_tag": parent.tag,
            "parent_sha256": parent_digests(parent),
            **timings,
            "_stream_bytes": stream_bytes,
        }
        if pages is not None:
            meta["changed_pages"] = pages
        names = (KERNEL_FILE, INITRD_FILE, DISK_FILE, STATE_FILE, memory_layer_name(meta))
        started = time.monotonic()
        meta["sha256"] = await asyncio.to_thread(seal_files, build_dir, names)
        meta["digest_seconds"] = round(time.monotonic() - started, 3)
        meta["sizes"] = {name: (build_dir / name).stat().st_size for name in names}
        return meta

    @staticmethod
    def _diff_memory(build_dir: Path, parent_chain: list[SnapshotRecord]) -> int:
        """Replace the full memory file by a layer of the pages that differ from the parent's memory."""
        memory = chain_memory(parent_chain)
        parent = memory_layers.ChainMemory(memory.base, [memory_layers.read_layer(p) for p in memory.layers])
        full = build_dir / MEMORY_FILE
        offsets = memory_layers.changed_pages(full, parent)
        memory_layers.write_layer(build_dir / LAYER_FILE, full, offsets)
        full.unlink()
        return len(offsets)

    async def diff_exec(self, base_tag: str, tag: str, command: str, timeout_s: float) -> SnapshotRecord:
        """Fork a child of ``base_tag``, run ``command`` in it, branch it as diff layer ``tag``, kill it."""
        check_tag(tag)
        if self.registry.get_snapshot(tag) is not None:
            raise SnapshotConflict(f"snapshot {tag!r} exists; pick another tag or remove it with `forkd rmi {tag}`")
        [outcome] = await self.sandboxes.fork(base_tag, 1)
        if outcome.sandbox is None:
            raise SnapshotError(f"could not fork {base_tag!r} to run the command: {outcome.error}")
        sandbox_id = outcome.sandbox["id"]
        try:
            stderr = bytearray()

            def on_event(name: str, data: dict[str, Any]) -> None:
                if name == protocol.EVENT_STDERR:
                    stderr.extend(protocol.b64decode(data.get("data_b64", "")))

            result = await self.sandboxes.get(sandbox_id).agent.call(
                protocol.OP_EXEC, {"shell": command, "timeout_s": timeout_s}, timeout=timeout_s + 30,
                on_event=on_event)
            if result.get("exit_code") != 0:
                raise SnapshotError(f"the command exited with {result.get('exit_code')} "
                                    f"(signal {result.get('signal')}), so no layer was saved: "
                                    f"{stderr.decode(errors='replace')[-500:].strip()}")
            return await self.branch(sandbox_id, tag, mode="diff", wait=True)
        finally:
            await self.sandboxes.kill(sandbox_id)

    async def wait_all(self) -> None:
        """Let branches being written finish (or fail) before the daemon stops their sources."""
        await asyncio.gather(*self._writing.values(), return_exceptions=True)

    def reap_stale(self) -> list[str]:
        """Snapshots a dead daemon left ``writing`` are marked failed; their build dirs are removed."""
        reaped = []
        for record in self.registry.list_snapshots():
            if record.status == "writing" and record.tag not in self._writing:
                self.registry.update_snapshot(record.tag, status="failed",
                                              meta={**record.meta, "error": "the daemon stopped while writing it"})
                reaped.append(record.tag)
        for leftover in self.paths.snapshots.glob(".build-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        return reaped
