"""Spawning: admission, restore and reseed, from a fork request to live children.

A child counts as spawned when its guest agent has been reseeded and has answered — not when the
VMM process starts; from then on it belongs to the sandboxes' lifecycle (``runtime/sandboxes.py``:
watch, release, kill, timeouts). In a batch, one failed child is reported, not fatal. Children
take ready VMMs from their snapshot's pool (``runtime/pool.py``, handed in) before starting their own.

Two gates stop children: a draining daemon (``runtime/drain.py``) refuses a whole fork before any
child starts, and a child stopped while it starts — its owner reaped (``reap``), or its fork given up
by the one who asked (``ForkHandle.stop``) — is refused before its restore (woken if it waits for a
restore slot), or killed once it answers, so it never becomes a live sandbox.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from forkd.config import Paths
from forkd.errors import INTERNAL, Failure, kind_for, message_for
from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError, connect_when_answering
from forkd.runtime.isolation import Isolation, Prepared, SandboxOptions, sandbox_meta
from forkd.runtime.metrics import Metrics
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.pool import Member, PoolService
from forkd.runtime.sandboxes import LiveSandbox, SandboxEnded, SandboxService
from forkd.runtime.timings import Timings
from forkd.runtime.warmup import reseed_args
from forkd.store.registry import Registry, SandboxRecord, SnapshotRecord
from forkd.store.snapshots import SnapshotStore
from forkd.store.space import SpaceFloor
from forkd.validation import new_sandbox_id
from forkd.vmm.base import BootSpec, SavedVm, Vmm, VmHandle
from forkd.vmm.process import start_time

RESTORE_ANSWER_TIMEOUT_S = 60.0
log = logging.getLogger("forkd.spawning")
T = TypeVar("T")


class SandboxLimitReached(RuntimeError):
    """The daemon's ``max_sandboxes`` limit is reached; this child is refused, the others are not."""

    kind = "busy"


class ReseedFailed(AgentError):
    """The child's guest kernel RNG was not reseeded, so it would share its randomness with its siblings."""

    def __init__(self, sandbox_id: str, answer: dict[str, Any]) -> None:
        skipped = ", ".join(answer.get("skipped") or []) or "none reported"
        super().__init__("reseed_failed", f"child {sandbox_id} did not reseed its kernel RNG (skipped: {skipped}); "
                         "it would share random numbers with its siblings, so it was killed. Check that the "
                         "image's agent runs as root (PID 1's child) and rebuild it with `forkd image build --force`")


STOPPING = "the daemon is stopping"


class Draining(RuntimeError):
    """This daemon is draining (``POST /v1/node/drain``): it starts no new children."""

    kind = "draining"


class ChildStopped(SandboxEnded):
    """The child was stopped while it started (its owner reaped, its fork given up); it was not kept."""


class DeadlinePassed(RuntimeError):
    """The caller's own deadline for a fork passed before this child answered; it was not kept."""

    kind = "timeout"


async def _settled(call: Callable[[], T]) -> T:
    """``call`` on a thread; a caller cancelled meanwhile (the daemon stopping) still waits for it to finish,
    so what it made (a network namespace, a record) exists when the caller's clean-up releases it."""
    running = asyncio.ensure_future(asyncio.to_thread(call))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise


def _remaining(deadline: float | None) -> float:
    """Seconds left until a monotonic ``deadline`` (a day when there is none; at least a moment)."""
    return 86400.0 if deadline is None else max(0.001, deadline - time.monotonic())


@dataclass(frozen=True)
class ForkOptions:
    """What a fork request sets per child besides the snapshot: lifetime, default env, labels."""

    timeout_s: float | None = None  # the daemon kills the child this long after it answered
    envs: dict[str, str] = field(default_factory=dict)  # defaults for every command run in it
    metadata: dict[str, str] = field(default_factory=dict)  # caller's labels, returned as given
    isolation: SandboxOptions = field(default_factory=SandboxOptions)  # network and resource limits
    deadline_s: float | None = None  # the caller waits no longer: children not answering by then are dropped
    owner: str | None = None  # the driver's label, stored with each child: its children are listed and reaped by it


@dataclass(eq=False)
class Starting:
    """One child from its admission until it answered or failed: what a reaper of its owner stops."""

    owner: str | None
    sandbox_id: str | None = None  # once its restore began
    why: str | None = None  # why it was stopped: it must not become a live sandbox
    stopped: bool = False  # the stop refused or killed it
    vm: VmHandle | None = None  # its VMM once started (or taken from a pool): what a stopping daemon kills
    done: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # wakes it while it waits for a restore slot

    def stop(self, why: str) -> None:
        self.why = why
        self.stopping.set()

    def refusal(self) -> ChildStopped | None:
        """The error to stop this child with if it was stopped (the caller kills what it started)."""
        if self.why is None:
            return None
        self.stopped = True
        return ChildStopped(f"child {self.sandbox_id or '(not started)'} was stopped as it started: {self.why}")


@dataclass(eq=False)
class ForkHandle:
    """The children of one fork request, for a caller that may give up on it (runtime/driver_forks.py):
    ``stop`` refuses those still starting, or kills them once they answer; ``answered`` lists the ids of
    those that became sandboxes before it."""

    why: str | None = None
    starting: set[Starting] = field(default_factory=set)
    answered: list[str] = field(default_factory=list)

    def join(self, child: Starting) -> None:
        self.starting.add(child)
        if self.why is not None:
            child.stop(self.why)

    def stop(self, why: str) -> None:
        self.why = why
        for child in self.starting:
            child.stop(why)


@dataclass
class ForkOutcome:
    """One child of a fork request: either a sandbox or the reason it failed, and where its time went."""

    index: int = 0  # the child's place in its request
    sandbox: dict[str, Any] | None = None
    error: Failure | None = None  # its kind's code and message
    seconds_to_answer: float | None = None
    timings: dict[str, float] = field(default_factory=dict)  # ms per spawn stage (runtime/timings.py)


class Spawner:
    """Turns fork requests into live children, handing each to ``sandboxes`` once it answered."""

    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, store: SnapshotStore, sandboxes: SandboxService,
                 pool: PoolService, isolation: Isolation, metrics: Metrics, space: SpaceFloor,
                 options: RuntimeOptions | None = None) -> None:
        self.paths = paths
        self.registry = registry
        self.vmm = vmm
        self.store = store
        self.sandboxes = sandboxes
        self.pool = pool
        self.isolation = isolation
        self.metrics = metrics
        self.space = space  # children's disk overlays grow under paths.sandboxes: forks leave its floor free
        self.options = options or RuntimeOptions()
        self._forking: Counter[str] = Counter()  # children being restored, per snapshot tag
        self._restoring = 0
        self._restore_slots = asyncio.Semaphore(self.options.restore_slots())
        self._batches: set[asyncio.Future[Any]] = set()
        self._children: set[asyncio.Future[None]] = set()  # each child's task, from admission to its outcome
        self._starting: set[Starting] = set()  # children admitted and not yet answered or failed
        self.draining = False  # set by runtime/drain.py: no fork is admitted
        self._stopped = False  # the daemon is stopping (stop()): no fork is admitted, none in flight is left

    def admit(self) -> None:
        """Refuse new children while the daemon drains or stops (checked before any work for a fork is done)."""
        if self._stopped:
            raise Draining(f"{STOPPING}: it starts no new sandboxes")
        if self.draining:
            raise Draining("this node is draining: it starts no new sandboxes (its running ones carry on); "
                           "DELETE /v1/node/drain makes it take forks again")

    def starting(self) -> int:
        """Children admitted that have not answered or failed yet."""
        return len(self._starting)

    def reap(self, owner: str) -> list[Starting]:
        """Mark the children of ``owner`` still starting: each is refused before its restore or killed once
        it answers. Synchronous, so with ``sandboxes.live()`` read at the same moment every child of the
        owner is in exactly one of the two (a child becomes live without an await after its last check)."""
        reaped = [child for child in self._starting if child.owner == owner]
        for child in reaped:
            child.stop(f"its owner {owner!r} was reaped (DELETE /v1/sandboxes?owner={owner})")
        return reaped

    async def stop(self) -> None:
        """The daemon stops: no fork is admitted from now on, and every child still starting is cancelled,
        its VMM killed and its run directory released whether or not the VMM was started yet; returns once
        all have ended. A child has no record before it answers, so none is left for the next daemon
        (``keep_sandboxes_on_stop`` keeps live sandboxes only); its fork's caller gets a ChildStopped for it."""
        self._stopped = True
        batches = list(self._batches)
        for starting in self._starting:
            starting.stop(STOPPING)  # one whose VMM starts from now on is refused as soon as it has it
        for child in list(self._children):
            child.cancel()  # its clean-up kills what it started; its batch ends once every child's has run
        # Killed here too, not only by each child's clean-up: a child busy in a step that does not end on
        # cancellation (a thread, a library's own wait) fails at once instead of at its timeout.
        await asyncio.gather(*(self.vmm.kill(c.vm) for c in self._starting if c.vm is not None),
                             return_exceptions=True)
        if batches:
            await asyncio.wait(batches)

    def count_of(self, tag: str) -> int:
        """Children of ``tag`` running or being restored."""
        return self._forking[tag] + self.sandboxes.running_of(tag)

    async def fork(self, tag: str, count: int, options: ForkOptions = ForkOptions(),
                   handle: ForkHandle | None = None) -> list[ForkOutcome]:
        """Restore ``count`` children of snapshot ``tag``; per-child outcome, in request order."""
        outcomes: list[ForkOutcome | None] = [None] * count
        async for outcome in await self.start_fork(tag, count, options, handle):
            outcomes[outcome.index] = outcome
        return [o for o in outcomes if o is not None]

    async def start_fork(self, tag: str, count: int, options: ForkOptions = ForkOptions(),
                         handle: ForkHandle | None = None) -> AsyncIterator[ForkOutcome]:
        """Start restoring ``count`` children of ``tag``; iterate the result for each one's outcome as it comes.

        A snapshot that cannot be forked raises here, before any child starts.

        Every child gets an outcome, whatever a sibling raised: ids of children that started are
        never lost. Children take ready VMMs from the snapshot's pool first, then start their own;
        all queue for the restore slots (admission), and the pool is refilled once the batch is done.
        If the consumer stops early, the children still finish starting (``forkd ls`` shows them),
        unless ``handle`` is stopped.
        """
        self.admit()
        started = time.monotonic()
        deadline = None if options.deadline_s is None else started + options.deadline_s
        # Counted before the first await, so `rmi` of this tag is refused while its children start.
        self._forking[tag] += count
        try:
            record, saved, spec = await asyncio.to_thread(self._open, tag, count)
            self.admit()  # the daemon may have begun stopping meanwhile: it waits for no batch made after
        except BaseException:
            self._forking[tag] -= count
            raise
        members: list[Member | None] = [*self.pool.take(record.tag, count, options.isolation)]
        members += [None] * (count - len(members))
        done: asyncio.Queue[ForkOutcome] = asyncio.Queue()

        async def one(index: int, member: Member | None) -> None:
            timings = Timings(started)
            child = Starting(options.owner)
            self._starting.add(child)
            if handle is not None:
                handle.join(child)
            try:
                with self.pool.serving():  # the pool refills once no child is starting
                    sandbox = await self._spawn(record.tag, saved, spec, options, timings, member, deadline, child)
            except asyncio.CancelledError:  # the daemon is stopping (stop()): what it started is gone
                if child.why is None:
                    child.stop(STOPPING)
                stopped = child.refusal() or ChildStopped(STOPPING)
                done.put_nowait(ForkOutcome(index=index, error=Failure.of(stopped), timings=timings.as_ms()))
                raise
            except Exception as exc:  # one child's failure, a bug's included, never takes its siblings with it
                kind = kind_for(exc)
                self.metrics.spawn_failures.labels(kind.code).inc()
                if kind is INTERNAL:  # no kind: a bug, whose traceback the log keeps
                    log.exception("spawning a child of %s failed", tag)
                else:  # the answer carries it too, but only to the caller: the operator reads it here
                    log.warning("a child of %s failed to start (%s): %s", tag, kind.code, message_for(exc))
                done.put_nowait(ForkOutcome(index=index, error=Failure.of(exc), timings=timings.as_ms()))
                return
            finally:
                self._forking[tag] -= 1
                self._starting.discard(child)
                if handle is not None:
                    handle.starting.discard(child)
                child.done.set()
            if handle is not None:  # no await since its last stop check: a stop from now on is the caller's
                handle.answered.append(sandbox.record.id)
            self.metrics.spawn_seconds.observe(timings.total)
            timings.observe(self.metrics.spawn_stage_seconds)
            done.put_nowait(ForkOutcome(index=index, sandbox=self.sandboxes.describe(sandbox),
                                        seconds_to_answer=timings.total, timings=timings.as_ms()))

        children = [asyncio.ensure_future(one(i, m)) for i, m in enumerate(members)]
        self._children.update(children)
        for task in children:
            task.add_done_callback(self._children.discard)
        # return_exceptions: a batch ends once every child has (a cancelled one, cleaned up, included).
        batch = asyncio.gather(*children, return_exceptions=True)
        self._batches.add(batch)  # runs to the end even when nobody iterates any more
        batch.add_done_callback(lambda _: (self._batches.discard(batch), self.pool.refill(record.tag)))

        async def outcomes() -> AsyncIterator[ForkOutcome]:
            for _ in range(count):
                yield await done.get()

        return outcomes()

    def _open(self, tag: str, count: int) -> tuple[SnapshotRecord, SavedVm, BootSpec]:
        """The snapshot to fork, once the disk the children's overlays grow on is above the floor (a
        guest that fills it gets I/O errors; forking more onto it would only starve them all)."""
        self.space.check(self.paths.sandboxes, 0, f"forking {count} child{'ren' if count != 1 else ''} of {tag!r}")
        return self.store.open(tag)

    async def _spawn(self, tag: str, saved: SavedVm, spec: BootSpec, options: ForkOptions, timings: Timings,
                     member: Member | None, deadline: float | None, child: Starting) -> LiveSandbox:
        restoring = False
        try:
            limit = self.options.max_sandboxes
            if limit is not None and len(self.sandboxes.live()) + self._restoring >= limit:
                raise SandboxLimitReached(f"the daemon runs its limit of {limit} sandboxes (max_sandboxes); kill "
                                          "some with `forkd kill` or raise the limit in the daemon's config")
            if (stopped := child.refusal()) is not None:
                raise stopped
            self._restoring += 1
            try:
                if not await self._slot(child, deadline):
                    raise child.refusal() or DeadlinePassed(
                        f"the request's deadline of {deadline - timings.start:.1f} s passed while this "  # type: ignore[operator]
                        "child waited for a restore slot; fork fewer at once or give more time")
                try:
                    timings.mark("queued")
                    if (stopped := child.refusal()) is not None:  # stopped as its slot came
                        raise stopped
                    restoring = True  # from here _restore owns the member: it kills it if the restore fails
                    return await self._restore(tag, saved, spec, options, timings, member, deadline, child)
                finally:
                    self._restore_slots.release()
            finally:
                self._restoring -= 1
        except BaseException:
            if member is not None and not restoring:  # refused or cancelled before its restore: it waits again
                self.pool.give_back(tag, member)
            raise

    async def _slot(self, child: Starting, deadline: float | None) -> bool:
        """Take a restore slot (True), unless ``deadline`` passes or the child is stopped first (False;
        a stopped child never waits for other forks' restores)."""
        acquire = asyncio.ensure_future(self._restore_slots.acquire())
        stopping = asyncio.ensure_future(child.stopping.wait())
        try:
            await asyncio.wait((acquire, stopping), timeout=_remaining(deadline), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not acquire.done():
                acquire.cancel()
        return acquire.done() and not acquire.cancelled()

    async def _restore(self, tag: str, saved: SavedVm, spec: BootSpec, options: ForkOptions, timings: Timings,
                       member: Member | None, deadline: float | None, child: Starting) -> LiveSandbox:
        """Restore one child (from a pool member if given); its record is written once, when it answers.

        Until then a crash leaves only its run directory, which recovery reaps with its VMM
        (found by the directory its command line names) and every releaser.
        """
        vm: VmHandle | None = None
        agent: AgentClient | None = None
        prepared: Prepared | None = None
        if member is not None:
            sandbox_id, run_dir, prepared, vm = member.sandbox_id, member.vm.run_dir, member.prepared, member.vm
            agent = member.agent  # a warm member: state loaded, first calls run, guest stopped
            timings.mark("pool")
        else:
            sandbox_id = new_sandbox_id()
            run_dir = self.paths.sandboxes / sandbox_id
            run_dir.mkdir(parents=True)
        child.sandbox_id = sandbox_id
        try:
            if vm is None:
                prepared = await _settled(lambda: self.isolation.prepare(sandbox_id, options.isolation))
                timings.mark("isolation")
                try:
                    vm = await self.vmm.prepare_restore(sandbox_id, saved, spec, run_dir,
                                                        dataclasses.replace(prepared.setup(), on_stage=timings.mark))
                finally:
                    prepared.close_tap()
            child.vm = vm
            if (stopped := child.refusal()) is not None:  # stopped while its VMM started (the daemon stopping)
                raise stopped
            answer_s = min(RESTORE_ANSWER_TIMEOUT_S, _remaining(deadline))
            if agent is None:
                await self.vmm.complete_restore(vm, saved, timings.mark)
                agent = await self._reseed(vm, sandbox_id, answer_s)
            else:
                await self.vmm.resume(vm)
                timings.mark("cont")
                await self._check_reseeded(agent, sandbox_id, await agent.call(
                    protocol.OP_RESEED, reseed_args(sandbox_id), timeout=answer_s))
            timings.mark("reseed")
            assert prepared is not None
            record = self._running_record(sandbox_id, tag, vm, options, prepared, timings)
            await _settled(lambda: self.registry.add_sandbox(record))
            timings.mark("recorded")
            if (stopped := child.refusal()) is not None:  # killed and released below, never served
                raise stopped
        except BaseException:
            if agent is not None:
                await agent.close()
            if vm is not None:
                await self.vmm.kill(vm)
            await self.sandboxes.release(sandbox_id, run_dir)
            raise
        agent.on_roundtrip = lambda op, seconds: self.metrics.agent_roundtrip_seconds.labels(op).observe(seconds)
        live = self.sandboxes.watch(record, vm, agent, prepared)
        live.record.meta["timings"] = timings.as_ms()  # shown with the sandbox; the record has them up to "recorded"
        return live

    @staticmethod
    async def _reseed(vm: VmHandle, sandbox_id: str, timeout_s: float) -> AgentClient:
        """The first answer a child gives is to its reseed: nothing runs on a copied RNG or clock.

        ``timeout_s`` counts from this child's own restore, not from the request.
        """
        agent, reseeded = await connect_when_answering(vm, timeout_s, protocol.OP_RESEED, reseed_args(sandbox_id))
        await Spawner._check_reseeded(agent, sandbox_id, reseeded)
        return agent

    @staticmethod
    async def _check_reseeded(agent: AgentClient, sandbox_id: str, reseeded: dict[str, Any]) -> None:
        if reseeded.get("kernel_rng") is not True:
            await agent.close()
            raise ReseedFailed(sandbox_id, reseeded)

    @staticmethod
    def _running_record(sandbox_id: str, tag: str, vm: VmHandle, options: ForkOptions, prepared: Prepared,
                        timings: Timings) -> SandboxRecord:
        """Everything about a child that just answered, in the one record written for it."""
        answered = round(timings.total, 4)
        meta = {"hostname": sandbox_id, "envs": options.envs, "metadata": options.metadata,
                "seconds_to_answer": answered, "timings": timings.as_ms(),
                **sandbox_meta(options.isolation, prepared.lease)}
        return SandboxRecord(id=sandbox_id, snapshot_tag=tag, status="running", pid=vm.pid, run_dir=vm.run_dir,
                             created_at=time.time(), meta=meta, vmm_started=start_time(vm.pid),
                             vmm_state=vm.state,
                             end_at=None if options.timeout_s is None else round(time.time() + options.timeout_s, 3),
                             owner=options.owner)
