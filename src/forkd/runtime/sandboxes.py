"""Sandboxes: children restored from a snapshot, each its own VMM process, disk overlay and identity.

A child counts as spawned when its guest agent has been reseeded and has answered — not when the
VMM process starts. Each child is watched: when its VMM exits for any reason, its overlay,
sockets and record are released. In a batch, one failed child is reported, not fatal.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import shutil
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError, connect_when_answering
from forkd.runtime.isolation import END_OUT_OF_MEMORY, Isolation, IsolationError, Prepared, SandboxOptions, sandbox_meta
from forkd.runtime.registry import Registry, SandboxRecord
from forkd.runtime.snapshots import SnapshotService
from forkd.vmm.base import BootSpec, MemoryStats, SavedVm, Vmm, VmHandle, VmmError

RESTORE_ANSWER_TIMEOUT_S = 60.0
ENDED_KEPT = 1000  # how many ended sandboxes GET /v1/sandboxes/{id} still describes
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
    isolation: Prepared | None = None


@dataclass
class ForkOutcome:
    """One child of a fork request: either a sandbox or the reason it failed."""

    sandbox: dict[str, Any] | None = None
    error: str | None = None
    seconds_to_answer: float | None = None


class SandboxService:
    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, snapshots: SnapshotService,
                 isolation: Isolation) -> None:
        self.paths = paths
        self.registry = registry
        self.vmm = vmm
        self.snapshots = snapshots
        self.isolation = isolation
        self._live: dict[str, LiveSandbox] = {}
        self._ended: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    async def fork(self, tag: str, count: int, options: SandboxOptions | None = None) -> list[ForkOutcome]:
        """Restore ``count`` children of snapshot ``tag`` concurrently; per-child outcome, same order."""
        started = time.monotonic()
        record, saved, spec = await asyncio.to_thread(self.snapshots.open, tag)

        async def one() -> ForkOutcome:
            try:
                sandbox = await self._spawn(record.tag, saved, spec, options or SandboxOptions())
            except (VmmError, AgentError, IsolationError, OSError) as exc:
                return ForkOutcome(error=str(exc))
            elapsed = time.monotonic() - started
            sandbox.record.meta["seconds_to_answer"] = round(elapsed, 4)
            self.registry.update_sandbox(sandbox.record.id, meta={"seconds_to_answer": round(elapsed, 4)})
            return ForkOutcome(sandbox=self.describe(sandbox), seconds_to_answer=elapsed)

        return list(await asyncio.gather(*(one() for _ in range(count))))

    async def _spawn(self, tag: str, saved: SavedVm, spec: BootSpec, options: SandboxOptions) -> LiveSandbox:
        sandbox_id = new_sandbox_id()
        run_dir = self.paths.sandboxes / sandbox_id
        run_dir.mkdir(parents=True)
        record = SandboxRecord(id=sandbox_id, snapshot_tag=tag, status="starting", pid=None, run_dir=run_dir,
                               created_at=time.time(), meta={"hostname": sandbox_id, **sandbox_meta(options, None)})
        self.registry.add_sandbox(record)  # first, so a crash from here on leaves a record to reap by
        vm: VmHandle | None = None
        agent: AgentClient | None = None
        prepared: Prepared | None = None
        try:
            prepared = await asyncio.to_thread(self.isolation.prepare, sandbox_id, options)
            record.meta.update(sandbox_meta(options, prepared.lease))
            self.registry.update_sandbox(sandbox_id, meta=record.meta)
            try:
                vm = await self.vmm.restore(sandbox_id, saved, spec, run_dir, prepared.setup())
            finally:
                prepared.close_tap()
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
            await self._release(sandbox_id, run_dir, network=options.net.mode == "nat")
            raise
        record.pid = vm.pid
        record.status = "running"
        self.registry.update_sandbox(sandbox_id, status="running")
        live = LiveSandbox(record=record, vm=vm, agent=agent, isolation=prepared)
        live.watcher = asyncio.create_task(self._watch(live))
        self._live[sandbox_id] = live
        return live

    async def _watch(self, live: LiveSandbox) -> None:
        """Release everything a child held as soon as its VMM process exits, however it died."""
        code = await live.vm.process.wait()
        record = live.record
        reason = self.isolation.end_reason(live.isolation)
        if reason == END_OUT_OF_MEMORY:
            limit = record.meta.get("limits", {}).get("memory_limit_mib")
            record.status, record.meta["exit_reason"] = "killed", reason
            log.warning("sandbox %s was killed by the kernel's OOM killer: its VMM exceeded its memory limit "
                        "(%s MiB)", record.id, limit)
        elif live.killing:
            record.status, record.meta["exit_reason"] = "killed", "requested"
        else:
            record.status, record.meta["exit_reason"] = "exited", f"exit status {code}"
        await live.agent.close()
        self._live.pop(record.id, None)
        self._ended[record.id] = {**record.to_dict(), "ended_at": time.time()}
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        await self._release(record.id, record.run_dir, network=record.meta.get("net", {}).get("mode") == "nat")

    async def _release(self, sandbox_id: str, run_dir: Path, network: bool) -> None:
        """Network, cgroup, files and record; a failure is logged and the rest still released."""
        try:
            await asyncio.to_thread(self.isolation.release, sandbox_id, network)
        except Exception as exc:  # noqa: BLE001 - the files and record must go regardless
            log.error("could not release the network/cgroup of %s: %s (`forkd doctor` lists leftovers)",
                      sandbox_id, exc)
        self._release_files(sandbox_id, run_dir)

    def _release_files(self, sandbox_id: str, run_dir: Path) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)
        self.registry.remove_sandbox(sandbox_id)

    def get(self, sandbox_id: str) -> LiveSandbox:
        live = self._live.get(sandbox_id)
        if live is None:
            ended = self._ended.get(sandbox_id)
            if ended is not None:
                raise SandboxNotFound(f"sandbox {sandbox_id!r} has ended: {ended['status']} "
                                      f"({ended['exit_reason']})")
            raise SandboxNotFound(f"no running sandbox {sandbox_id!r}; list them with `forkd ls`")
        return live

    def lookup(self, sandbox_id: str) -> dict[str, Any]:
        """A running sandbox with its memory and cgroup figures, or the final record of an ended one."""
        if sandbox_id not in self._live and sandbox_id in self._ended:
            return self._ended[sandbox_id]
        return self.describe(self.get(sandbox_id), with_memory=True)

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
            cgroup = self.isolation.usage(live.isolation)
            if cgroup is not None:
                info["cgroup"] = cgroup
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
            self._reap_isolation(record.id)
            self._release_files(record.id, record.run_dir)
            reaped.append(record.id)
        for sandbox_id in set(self.registry.leases()) - set(self._live):  # a lease without a record
            self._reap_isolation(sandbox_id)
        if self.paths.sandboxes.exists():
            known = {r.id for r in self.registry.list_sandboxes()}
            for leftover in self.paths.sandboxes.iterdir():
                if leftover.name not in known:
                    shutil.rmtree(leftover, ignore_errors=True)
        return reaped


    def _reap_isolation(self, sandbox_id: str) -> None:
        try:
            removed = self.isolation.release(sandbox_id)
        except Exception as exc:  # noqa: BLE001 - reaping goes on with the next one
            log.error("could not remove the network/cgroup of %s: %s", sandbox_id, exc)
            return
        if removed:
            log.warning("removed what a previous daemon left of %s: %s", sandbox_id, ", ".join(removed))


def _is_vmm_of(pid: int, run_dir: Path) -> bool:
    """Only signal a pid that is still the VMM we started (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(run_dir).encode() in cmdline
