"""Sandboxes: children restored from a snapshot, each its own VMM process, disk overlay and identity.

A child counts as spawned when its guest agent has been reseeded and has answered — not when the
VMM process starts. Each child is watched: when its VMM exits for any reason, its overlay,
sockets and record are released. In a batch, one failed child is reported, not fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError, connect_when_answering
from forkd.runtime.metrics import Metrics
from forkd.runtime.registry import Registry, SandboxRecord
from forkd.runtime.snapshots import SnapshotService
from forkd.vmm.base import BootSpec, MemoryStats, SavedVm, Vmm, VmHandle, VmmError

RESTORE_ANSWER_TIMEOUT_S = 60.0
log = logging.getLogger("forkd.sandboxes")
_ID_ALPHABET = string.ascii_lowercase + string.digits


class SandboxNotFound(LookupError):
    pass


def new_sandbox_id() -> str:
    return "sb-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))


@dataclass
class LiveSandbox:
    record: SandboxRecord
    vm: VmHandle
    agent: AgentClient
    watcher: asyncio.Task[None] | None = None
    killing: bool = False


@dataclass(frozen=True)
class ForkOptions:
    """What a fork request sets per child besides the snapshot: lifetime, default env, labels."""

    timeout_s: float | None = None  # the daemon kills the child this long after it answered
    envs: dict[str, str] = field(default_factory=dict)  # defaults for every command run in it
    metadata: dict[str, str] = field(default_factory=dict)  # caller's labels, returned as given


@dataclass
class ForkOutcome:
    """One child of a fork request: either a sandbox or the reason it failed."""

    sandbox: dict[str, Any] | None = None
    error: str | None = None
    seconds_to_answer: float | None = None


class SandboxService:
    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, snapshots: SnapshotService,
                 metrics: Metrics) -> None:
        self.paths = paths
        self.metrics = metrics
        self.registry = registry
        self.vmm = vmm
        self.snapshots = snapshots
        self._live: dict[str, LiveSandbox] = {}

    async def fork(self, tag: str, count: int, options: ForkOptions = ForkOptions()) -> list[ForkOutcome]:
        """Restore ``count`` children of snapshot ``tag`` concurrently; per-child outcome, same order."""
        started = time.monotonic()
        record, saved, spec = await asyncio.to_thread(self.snapshots.open, tag)

        async def one() -> ForkOutcome:
            try:
                sandbox = await self._spawn(record.tag, saved, spec, options)
            except (VmmError, AgentError, OSError) as exc:
                self.metrics.spawn_failures.inc()
                return ForkOutcome(error=str(exc))
            elapsed = time.monotonic() - started
            self.metrics.spawn_seconds.observe(elapsed)
            self._update_meta(sandbox, seconds_to_answer=round(elapsed, 4))
            if options.timeout_s is not None:
                self.set_timeout(sandbox.record.id, options.timeout_s)
            return ForkOutcome(sandbox=self.describe(sandbox), seconds_to_answer=elapsed)

        return list(await asyncio.gather(*(one() for _ in range(count))))

    async def _spawn(self, tag: str, saved: SavedVm, spec: BootSpec, options: ForkOptions) -> LiveSandbox:
        sandbox_id = new_sandbox_id()
        run_dir = self.paths.sandboxes / sandbox_id
        run_dir.mkdir(parents=True)
        record = SandboxRecord(id=sandbox_id, snapshot_tag=tag, status="starting", pid=None, run_dir=run_dir,
                               created_at=time.time(), meta={"hostname": sandbox_id, "envs": options.envs,
                                                             "metadata": options.metadata, "end_at": None})
        self.registry.add_sandbox(record)
        vm: VmHandle | None = None
        agent: AgentClient | None = None
        try:
            vm = await self.vmm.restore(sandbox_id, saved, spec, run_dir)
            self.registry.update_sandbox(sandbox_id, pid=vm.pid)
            # The first answer a child gives is to its reseed: nothing runs on a copied RNG or clock.
            agent, _ = await connect_when_answering(vm.agent_socket, vm.process, RESTORE_ANSWER_TIMEOUT_S,
                                                    protocol.OP_RESEED, {
                "entropy_b64": protocol.b64encode(os.urandom(64)),
                "time_ns": time.time_ns(),
                "hostname": sandbox_id,
                "sandbox_id": sandbox_id,
            })
        except BaseException:
            if agent is not None:
                await agent.close()
            if vm is not None:
                await self.vmm.kill(vm)
            self._release_files(sandbox_id, run_dir)
            raise
        agent.on_roundtrip = lambda op, seconds: self.metrics.agent_roundtrip_seconds.labels(op).observe(seconds)
        record.pid = vm.pid
        record.status = "running"
        self.registry.update_sandbox(sandbox_id, status="running")
        live = LiveSandbox(record=record, vm=vm, agent=agent)
        live.watcher = asyncio.create_task(self._watch(live))
        self._live[sandbox_id] = live
        return live

    async def _watch(self, live: LiveSandbox) -> None:
        """Release everything a child held as soon as its VMM process exits, however it died."""
        code = await live.vm.process.wait()
        if not live.killing:
            live.record.status = f"exited({code})"
        await live.agent.close()
        self._live.pop(live.record.id, None)
        self._release_files(live.record.id, live.record.run_dir)

    def _release_files(self, sandbox_id: str, run_dir: Path) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)
        self.registry.remove_sandbox(sandbox_id)

    def _update_meta(self, live: LiveSandbox, **meta: Any) -> None:
        live.record.meta.update(meta)
        self.registry.update_sandbox(live.record.id, meta=meta)

    def set_timeout(self, sandbox_id: str, timeout_s: float) -> float:
        """Kill the sandbox ``timeout_s`` from now (replacing any earlier deadline); returns the deadline."""
        end_at = round(time.time() + timeout_s, 3)
        self._update_meta(self.get(sandbox_id), end_at=end_at)
        return end_at

    async def expire(self, now: float | None = None) -> list[str]:
        """Kill every sandbox whose deadline has passed; returns their ids."""
        now = time.time() if now is None else now
        expired = [s.record.id for s in self.live()
                   if s.record.meta.get("end_at") is not None and s.record.meta["end_at"] <= now and not s.killing]
        for sandbox_id in expired:
            log.info("sandbox %s reached its timeout: killing it", sandbox_id)
            with contextlib.suppress(SandboxNotFound):
                await self.kill(sandbox_id)
        return expired

    async def expire_forever(self, interval_s: float = 1.0) -> None:
        """The daemon's deadline keeper: a sandbox outlives its timeout by at most ``interval_s``."""
        while True:
            await asyncio.sleep(interval_s)
            await self.expire()

    def get(self, sandbox_id: str) -> LiveSandbox:
        live = self._live.get(sandbox_id)
        if live is None:
            raise SandboxNotFound(f"no running sandbox {sandbox_id!r}; list them with `forkd ls`")
        return live

    def live(self) -> list[LiveSandbox]:
        return list(self._live.values())

    def count_of(self, tag: str) -> int:
        return sum(1 for s in self._live.values() if s.record.snapshot_tag == tag)

    def describe(self, live: LiveSandbox, with_memory: bool = False) -> dict[str, Any]:
        info = live.record.to_dict()
        if with_memory:
            with contextlib.suppress(VmmError):
                stats: MemoryStats = self.vmm.memory_stats(live.vm)
                info["memory"] = {"pss_kib": stats.pss_kib, "private_dirty_kib": stats.private_dirty_kib,
                                  "rss_kib": stats.rss_kib}
        return info

    async def kill(self, sandbox_id: str) -> None:
        live = self.get(sandbox_id)
        live.killing = True
        await self.vmm.kill(live.vm)
        if live.watcher is not None:
            await live.watcher

    async def kill_all(self) -> None:
        await asyncio.gather(*(self.kill(s.record.id) for s in self.live()), return_exceptions=True)

    def reap_stale(self) -> list[str]:
        """Records left by a daemon that died: kill their VMMs and free their files.

        Re-adopting live children across a daemon restart is not done yet; reaping them is the
        safe alternative to leaking them.
        """
        reaped = []
        for record in self.registry.list_sandboxes():
            if record.id in self._live:
                continue
            if record.pid and _is_vmm_of(record.pid, record.run_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record.pid, 9)
            self._release_files(record.id, record.run_dir)
            reaped.append(record.id)
        if self.paths.sandboxes.exists():
            known = {r.id for r in self.registry.list_sandboxes()}
            for leftover in self.paths.sandboxes.iterdir():
                if leftover.name not in known:
                    shutil.rmtree(leftover, ignore_errors=True)
        return reaped


def _is_vmm_of(pid: int, run_dir: Path) -> bool:
    """Only signal a pid that is still the VMM we started (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(run_dir).encode() in cmdline
