"""Idle children cost nothing: a child nobody has asked anything for a while is stopped (QMP ``stop``)
and continued (``cont``) on its next request, transparently.

Under TCG an idle guest still costs its VMM CPU (timer ticks, QEMU's own timers): a few hundred idle
children saturate a small host. Every request to a sandbox's agent passes one point,
``AgentClient.before_request``; there a stopped guest is continued and its wall clock set (a stopped
guest's clock stands still) before the request is sent. The keeper's sweep stops a child when all of
this holds: no request for ``idle_s``, none in flight (a command, a streamed cell, a watch's long
poll), its VMM used under ``BUSY_CPU_SHARE`` of a core since the last sweep, and its guest answers
``activity`` with no user process (a background command, a server, a PTY) and no open watch.

One lock per child orders a stop and a wake: a request arriving while a stop is in flight waits for
it, then continues the guest. Operations that reach the VMM itself (BRANCH's capture) hold the child
awake with :meth:`IdleStops.awake`. Right after a stop the child's memory is paged out to swap, if the
host has any (runtime/reclaim.py); its next request faults it back in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError, AgentUnavailable
from forkd.runtime.reclaim import Reclaim
from forkd.vmm.base import VmHandle, Vmm, VmmError
from forkd.vmm.process import cpu_seconds

RUNNING, STOPPING, STOPPED = "running", "stopping", "idle_stopped"
DEFAULT_IDLE_STOP_S = 60.0  # RuntimeOptions.idle_stop_s: a child idle this long is stopped; 0 never
BUSY_CPU_SHARE = 0.05  # a VMM that used more of a core than this since the last sweep is working
STOPS_AT_ONCE = 16  # children asked `activity` and stopped at the same time in one round
GUEST_CALL_TIMEOUT_S = 5.0  # for `activity` and `clock.set`, which answer at once
log = logging.getLogger("forkd.idle")


@dataclass(eq=False)
class _Child:
    vm: VmHandle
    agent: AgentClient
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    state: str = RUNNING
    stopped_at: float | None = None  # wall clock, for listings
    checked: float = 0.0  # monotonic: when the guest last said it was busy (not asked again for idle_s)
    cpu: tuple[float, float] | None = None  # (monotonic, CPU seconds of its VMM) at the last sweep
    stoppable: bool = True  # False once its agent answered unknown_op to `activity` (an older agent)
    reclaimed_kib: int | None = None  # Private_Dirty paged out since it was stopped, for listings


class IdleStops:
    """The idle stops of one daemon's live children, by sandbox id."""

    def __init__(self, vmm: Vmm, idle_s: float, reclaim: bool = True) -> None:
        self.vmm = vmm
        self.idle_s = idle_s
        self.reclaim = Reclaim(vmm, reclaim)
        self._children: dict[str, _Child] = {}
        self._reclaims: set[asyncio.Task[None]] = set()  # kept until done

    def attach(self, sandbox_id: str, vm: VmHandle, agent: AgentClient) -> None:
        """Serve ``sandbox_id``'s requests through the wake below (its guest is running)."""
        child = _Child(vm, agent)
        self._children[sandbox_id] = child
        agent.before_request = lambda: self._wake(child)

    def forget(self, sandbox_id: str) -> None:
        self._children.pop(sandbox_id, None)

    def state(self, sandbox_id: str) -> dict[str, Any]:
        """``vm_state`` (running, stopping, idle_stopped), since when it is stopped and how much of its
        memory was paged out then, for listings."""
        child = self._children.get(sandbox_id)
        if child is None or child.state == RUNNING:
            return {"vm_state": RUNNING}
        state: dict[str, Any] = {"vm_state": child.state, "stopped_at": child.stopped_at}
        if child.reclaimed_kib is not None:
            state["reclaimed_kib"] = child.reclaimed_kib
        return state

    def stopped(self) -> int:
        return sum(1 for child in self._children.values() if child.state == STOPPED)

    async def sweep(self) -> list[str]:
        """Stop every child idle long enough (see the module's doc); returns the ids stopped."""
        if self.idle_s <= 0 or not self._children:
            return []
        children = list(self._children.items())
        now = time.monotonic()
        cpu = await asyncio.to_thread(lambda: [cpu_seconds(child.vm.pid) for _, child in children])
        candidates = []
        for (sandbox_id, child), used in zip(children, cpu):
            working = used is not None and child.cpu is not None and \
                used - child.cpu[1] > BUSY_CPU_SHARE * (now - child.cpu[0])
            if used is not None:
                child.cpu = (now, used)
            if not working and not child.lock.locked() and self._idle(child, now):
                candidates.append((sandbox_id, child))
        slots = asyncio.Semaphore(STOPS_AT_ONCE)  # one guest slow to answer `activity` holds up no other

        async def stop(sandbox_id: str, child: _Child) -> bool:
            async with slots:
                try:
                    return await self._stop(child)
                except Exception as exc:  # its VMM exited, or its agent failed: its watcher deals with that
                    child.checked = time.monotonic()  # asked again after another idle time, not every round
                    log.warning("sandbox %s: stopping it while idle failed (%s); it keeps running", sandbox_id, exc)
                    return False

        done = await asyncio.gather(*(stop(sandbox_id, child) for sandbox_id, child in candidates))
        stopped = [(sandbox_id, child) for (sandbox_id, child), ok in zip(candidates, done) if ok]
        for sandbox_id, child in stopped:
            task = asyncio.create_task(self._reclaim(sandbox_id, child))
            self._reclaims.add(task)
            task.add_done_callback(self._reclaims.discard)
        return [sandbox_id for sandbox_id, _ in stopped]

    async def _reclaim(self, sandbox_id: str, child: _Child) -> None:
        """Page out a stopped child's memory until it is continued or forgotten (runtime/reclaim.py)."""
        def still_stopped() -> bool:
            return child.state == STOPPED and self._children.get(sandbox_id) is child

        try:
            dropped = await self.reclaim.run(child.vm, still_stopped)
        except Exception:
            log.exception("sandbox %s: paging out its memory failed", sandbox_id)
            return
        if dropped is not None and still_stopped():
            child.reclaimed_kib = dropped

    def _idle(self, child: _Child, now: float) -> bool:
        return (child.state == RUNNING and child.stoppable and not child.agent.closed
                and child.agent.in_flight == 0
                and now - max(child.agent.last_request, child.checked) >= self.idle_s)

    async def _stop(self, child: _Child) -> bool:
        async with child.lock:
            if not self._idle(child, time.monotonic()):  # a request came while the lock was awaited
                return False
            child.state = STOPPING  # from here a request waits for the lock, then continues the guest
            try:
                activity = await child.agent.call(protocol.OP_ACTIVITY, timeout=GUEST_CALL_TIMEOUT_S, wake=False)
                # A request that passed before the state changed is in flight now: the guest is not idle.
                if activity.get("processes") or activity.get("watches") or child.agent.in_flight:
                    child.checked = time.monotonic()
                    child.state = RUNNING
                    return False
                await self.vmm.pause(child.vm)
            except AgentError as exc:
                child.state = RUNNING
                if exc.code == protocol.ERR_UNKNOWN_OP:
                    child.stoppable = False  # cannot tell its background work: never stopped
                    log.info("%s: its agent predates `activity` (an older snapshot), so it is never stopped "
                             "while idle", child.vm.name)
                    return False
                raise
            except BaseException:
                child.state = RUNNING
                raise
            child.state, child.stopped_at = STOPPED, time.time()
            return True

    async def _wake(self, child: _Child) -> None:
        """Before a request: a stopped guest is continued and its clock set; a stop in flight is waited for."""
        if child.state == RUNNING:
            return  # no await on this path: the request is in flight before any stop can look
        async with child.lock:
            try:
                await self._continue(child)
            except VmmError as exc:  # its VMM is gone: the request fails as on a lost connection
                raise AgentUnavailable(f"continuing the stopped guest failed: {exc}") from None

    async def _continue(self, child: _Child) -> None:
        if child.state != STOPPED:
            return
        await self.vmm.resume(child.vm)
        child.state, child.stopped_at, child.reclaimed_kib = RUNNING, None, None
        try:
            await child.agent.call(protocol.OP_CLOCK_SET, {"time_ns": time.time_ns()},
                                   timeout=GUEST_CALL_TIMEOUT_S, wake=False)
        except AgentError as exc:  # an older agent: its clock lags by the time it was stopped
            log.warning("%s: setting the guest's clock after an idle stop failed (%s)", child.vm.name, exc)

    @contextlib.asynccontextmanager
    async def awake(self, sandbox_id: str) -> AsyncIterator[None]:
        """Hold a child running (continued first if stopped) while the caller works on its VMM itself."""
        child = self._children.get(sandbox_id)
        if child is None:
            yield
            return
        async with child.lock:
            await self._continue(child)
            yield


async def correct_clock(agent: AgentClient) -> None:
    """Set the guest's wall clock to the host's (a guest found stopped by a restarted daemon)."""
    with contextlib.suppress(AgentError):
        await agent.call(protocol.OP_CLOCK_SET, {"time_ns": time.time_ns()}, timeout=GUEST_CALL_TIMEOUT_S, wake=False)
