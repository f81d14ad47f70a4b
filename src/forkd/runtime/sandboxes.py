"""Sandboxes' lifecycle: a live child watched until its VMM exits, then released; kills, timeouts,
and the ended ones remembered for a while.

Children come here from ``runtime/spawning.py`` once they answered (or from recovery, re-adopted
after a daemon restart). When a VMM exits for any reason, its overlay, sockets, host resources and
record are released. The keepers that enforce deadlines and console bounds are in ``runtime/keepers.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.runtime.agent_client import AgentClient
from forkd.host.netpolicy import EgressPolicy
from forkd.runtime.idle import IdleStops
from forkd.runtime.isolation import END_OUT_OF_MEMORY, Isolation, Prepared
from forkd.store.io import remove_tree
from forkd.store.registry import Registry, SandboxRecord
from forkd.vmm.base import MemoryStats, Vmm, VmHandle, VmmError

ENDED_KEPT = 1000  # how many ended sandboxes GET /v1/sandboxes/{id} still describes
log = logging.getLogger("forkd.sandboxes")


class SandboxNotFound(LookupError):
    kind = "not_found"


class SandboxEnded(RuntimeError):
    """The sandbox ended (its timeout, a kill, its VMM exited) while an operation on it ran."""

    kind = "sandbox_ended"


# Frees one per-sandbox host resource (netns, cgroup, tap, ...) by sandbox id. Called whenever a
# sandbox is released — its VMM exited, it was killed, or a restarted daemon reaps it or finds its
# directory without a record — so it must be idempotent and must not fail when there is nothing to free.
Releaser = Callable[[str], None]


class NetworkModeConflict(RuntimeError):
    """A network change the sandbox's mode cannot take (no link to put rules on)."""

    kind = "conflict"


@dataclass
class LiveSandbox:
    record: SandboxRecord
    vm: VmHandle
    agent: AgentClient
    watcher: asyncio.Task[None] | None = None
    killing: bool = False
    isolation: Prepared | None = None
    kill_reason: str = "requested"  # the exit_reason a kill is reported with


class SandboxService:
    """The live sandboxes of this daemon, and what ended lately."""

    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, isolation: Isolation,
                 idle_stop_s: float = 0.0, idle_reclaim: bool = True) -> None:
        self.paths = paths
        self.registry = registry
        self.vmm = vmm
        self.isolation = isolation
        # Per-sandbox resources beyond files and record, freed by id (each runs in a worker thread).
        self.releasers: list[Releaser] = [self._release_isolation]
        self._live: dict[str, LiveSandbox] = {}
        self._ended: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._killers: set[asyncio.Task[None]] = set()  # kills started by a callback, kept until done
        # idle children stopped (their memory paged out to swap), continued on their next request
        self.idle = IdleStops(vmm, idle_stop_s, idle_reclaim)

    def watch(self, record: SandboxRecord, vm: VmHandle, agent: AgentClient,
              isolation: Prepared | None = None) -> LiveSandbox:
        """Serve a running child: a fresh one, or one re-adopted after a daemon restart (``isolation`` None)."""
        live = LiveSandbox(record=record, vm=vm, agent=agent, isolation=isolation)
        live.watcher = asyncio.create_task(self._watch(live))
        agent.on_violation = lambda detail: self._agent_violated(live, detail)
        self.idle.attach(record.id, vm, agent)
        self._live[record.id] = live
        return live

    def _agent_violated(self, live: LiveSandbox, detail: str) -> None:
        """A guest that broke the protocol is not served any further: kill it and release what it held."""
        log.warning("sandbox %s: the guest broke the agent protocol (%s); killing it", live.record.id, detail)
        if not live.killing:
            live.kill_reason = "agent_protocol_violation"
            live.killing = True
            killer = asyncio.get_running_loop().create_task(self.vmm.kill(live.vm))  # the watcher releases it
            self._killers.add(killer)
            killer.add_done_callback(self._killers.discard)

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
            record.status, record.meta["exit_reason"] = "killed", live.kill_reason
        else:
            record.status, record.meta["exit_reason"] = "exited", f"exit status {code}"
        await live.agent.close()
        self._ended[record.id] = {**record.to_dict(), "ended_at": time.time()}
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        await self.release(record.id, record.run_dir)
        self.idle.forget(record.id)
        self._live.pop(record.id, None)  # listed until released: gone from `ls` means gone from the host

    def _release_isolation(self, sandbox_id: str) -> None:
        record = self.registry.get_sandbox(sandbox_id)  # still there: the record is removed last
        # Only a nat sandbox has network objects; without a record (a stray directory) look anyway.
        network = record is None or record.meta.get("net", {}).get("mode") == "nat"
        removed = self.isolation.release(sandbox_id, network=network)
        if removed:
            log.info("released %s: %s", sandbox_id, ", ".join(removed))

    async def release(self, sandbox_id: str, run_dir: Path) -> None:
        """Free everything a sandbox whose VMM is gone held: plugged-in resources, files, then the record.

        The record goes last, so a daemon dying midway finds it again on restart and finishes the job.
        Releasers, file removal and the record's deletion run in worker threads (pyroute2's netlink
        calls block and keep their own loop; SQLite and rmtree must not stall the event loop).
        """
        for releaser in self.releasers:
            try:
                await asyncio.to_thread(releaser, sandbox_id)
            except Exception:  # one resource that cannot be freed must not keep the others
                log.exception("releasing %s for %s failed", getattr(releaser, "__name__", releaser), sandbox_id)
        await remove_tree(run_dir)  # a child's overlay can hold gigabytes: deleted off the loop
        await asyncio.to_thread(self.registry.remove_sandbox, sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout_s: float) -> float:
        """Kill the sandbox ``timeout_s`` from now (replacing any earlier deadline); returns the deadline."""
        live = self.get(sandbox_id)
        live.record.end_at = round(time.time() + timeout_s, 3)  # the expiry sweep sees it at once
        await asyncio.to_thread(self.registry.set_end_at, sandbox_id, live.record.end_at)  # a restart keeps it
        return live.record.end_at

    async def expire(self, now: float | None = None) -> list[str]:
        """Kill every sandbox whose deadline has passed; returns their ids.

        One sandbox that cannot be killed is logged and retried next time; it never spares the others.
        """
        now = time.time() if now is None else now
        expired = [s.record.id for s in self.live()
                   if s.record.end_at is not None and s.record.end_at <= now and not s.killing]
        for sandbox_id in expired:
            log.info("sandbox %s reached its timeout: killing it", sandbox_id)
            try:
                await self.kill(sandbox_id)
            except SandboxNotFound:
                pass
            except Exception:
                log.exception("killing sandbox %s at its timeout failed; trying again", sandbox_id)
        return expired

    def get(self, sandbox_id: str) -> LiveSandbox:
        live = self._live.get(sandbox_id)
        if live is None:
            ended = self._ended.get(sandbox_id)
            if ended is not None:
                raise SandboxNotFound(f"sandbox {sandbox_id!r} has ended: {ended['status']} "
                                      f"({ended['exit_reason']})")
            raise SandboxNotFound(f"no running sandbox {sandbox_id!r}; list them with `forkd ls`")
        return live

    async def ended(self, sandbox_id: str, within_s: float = 5.0) -> bool:
        """Whether the sandbox ended; its watcher, which notices the VMM's exit, gets ``within_s`` to see it.

        For callers whose agent connection or VMM just failed: was that the sandbox ending (a timeout,
        a kill) rather than a fault?
        """
        live = self._live.get(sandbox_id)
        if live is None:
            return True
        if live.watcher is None:
            return False
        await asyncio.wait({live.watcher}, timeout=within_s)
        return live.watcher.done()

    def lookup(self, sandbox_id: str) -> dict[str, Any]:
        """A running sandbox with its memory and cgroup figures, or the final record of an ended one."""
        if sandbox_id not in self._live and sandbox_id in self._ended:
            return self._ended[sandbox_id]
        return self.describe(self.get(sandbox_id), with_memory=True)

    def live(self) -> list[LiveSandbox]:
        return list(self._live.values())

    def running_of(self, tag: str) -> int:
        """Children of ``tag`` running (those being restored are counted by the spawner)."""
        return sum(1 for s in self._live.values() if s.record.snapshot_tag == tag)

    async def set_labels(self, sandbox_id: str, labels: dict[str, str]) -> None:
        """Replace a running sandbox's labels, in its record too, so a restarted daemon has them."""
        live = self.get(sandbox_id)
        live.record.meta["metadata"] = dict(labels)
        await asyncio.to_thread(self.registry.set_labels, sandbox_id, dict(labels))

    async def set_egress(self, sandbox_id: str, policy: EgressPolicy) -> None:
        """Replace a running ``nat`` sandbox's egress policy, in its namespace and its record."""
        live = self.get(sandbox_id)
        net = live.record.meta.get("net") or {}
        if net.get("mode") != "nat" or not net.get("address"):
            raise NetworkModeConflict(f"sandbox {sandbox_id} has no network link (net {net.get('mode', 'none')!r}); "
                                      "its egress can change only if it was started with net 'nat'")
        await asyncio.to_thread(self.isolation.replace_egress, sandbox_id, str(net["address"]), policy)
        live.record.meta["net"] = {**net, "egress": policy.to_dict()}
        await asyncio.to_thread(self.registry.set_egress, sandbox_id, policy.to_dict())

    def describe(self, live: LiveSandbox, with_memory: bool = False) -> dict[str, Any]:
        info = {**live.record.to_dict(), **self.idle.state(live.record.id)}
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
        """Kill every child and wait until each is released (a child already dying when this began
        included), so nothing is released after the registry has closed."""
        lives = self.live()
        await asyncio.gather(*(self.kill(s.record.id) for s in lives), return_exceptions=True)
        await asyncio.gather(*(s.watcher for s in lives if s.watcher is not None), return_exceptions=True)

    async def detach_all(self) -> None:
        """Stop serving every child but leave its VMM running and its record in place, for the next daemon."""
        for live in self.live():
            if live.watcher is not None:
                live.watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await live.watcher
            await live.agent.close()
            self.idle.forget(live.record.id)  # a stopped one stays stopped: the next daemon continues it
            close = getattr(live.vm.process, "close", None)  # an adopted VMM's pidfd
            if close is not None:
                close()
        self._live.clear()
