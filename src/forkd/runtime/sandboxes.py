"""Sandboxes: children restored from a snapshot, each its own VMM process, disk overlay and identity.

A child counts as spawned when its guest agent has been reseeded and has answered — not when the
VMM process starts. Each child is watched: when its VMM exits for any reason, its overlay,
sockets and record are released. In a batch, one failed child is reported, not fatal.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import string
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError, connect_when_answering
from forkd.runtime.metrics import Metrics
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.pool import Member, PoolService
from forkd.runtime.isolation import END_OUT_OF_MEMORY, Isolation, IsolationError, Prepared, SandboxOptions, sandbox_meta
from forkd.store.io import remove_tree
from forkd.store.registry import Registry, SandboxRecord
from forkd.runtime.snapshots import SnapshotService
from forkd.runtime.timings import Timings
from forkd.runtime.warmup import reseed_args
from forkd.vmm.base import BootSpec, MemoryStats, SavedVm, Vmm, VmHandle, VmmError
from forkd.vmm.process import start_time

RESTORE_ANSWER_TIMEOUT_S = 60.0
CONSOLE_MAX_BYTES = 16 << 20  # a live sandbox's console is cut past this (see VmHandle.bound_logs)
LOG_CHECK_S = 5.0  # how often: a console can outgrow the bound by what a guest writes in this time
ENDED_KEPT = 1000  # how many ended sandboxes GET /v1/sandboxes/{id} still describes
log = logging.getLogger("forkd.sandboxes")
_ID_ALPHABET = string.ascii_lowercase + string.digits


class SandboxNotFound(LookupError):
    pass


class SandboxEnded(RuntimeError):
    """The sandbox ended (its timeout, a kill, its VMM exited) while an operation on it ran."""


class SandboxLimitReached(RuntimeError):
    """The daemon's ``max_sandboxes`` limit is reached; this child is refused, the others are not."""


class ReseedFailed(AgentError):
    """The child's guest kernel RNG was not reseeded, so it would share its randomness with its siblings."""

    def __init__(self, sandbox_id: str, answer: dict[str, Any]) -> None:
        skipped = ", ".join(answer.get("skipped") or []) or "none reported"
        super().__init__("reseed_failed", f"child {sandbox_id} did not reseed its kernel RNG (skipped: {skipped}); "
                         "it would share random numbers with its siblings, so it was killed. Check that the "
                         "image's agent runs as root (PID 1's child) and rebuild it with `forkd image build --force`")


class DeadlinePassed(RuntimeError):
    """The caller's own deadline for a fork passed before this child answered; it was not kept."""


def _remaining(deadline: float | None) -> float:
    """Seconds left until a monotonic ``deadline`` (a day when there is none; at least a moment)."""
    return 86400.0 if deadline is None else max(0.001, deadline - time.monotonic())


# Frees one per-sandbox host resource (netns, cgroup, tap, ...) by sandbox id. Called whenever a
# sandbox is released — its VMM exited, it was killed, or a restarted daemon reaps it or finds its
# directory without a record — so it must be idempotent and must not fail when there is nothing to free.
Releaser = Callable[[str], None]


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
    kill_reason: str = "requested"  # the exit_reason a kill is reported with


@dataclass(frozen=True)
class ForkOptions:
    """What a fork request sets per child besides the snapshot: lifetime, default env, labels."""

    timeout_s: float | None = None  # the daemon kills the child this long after it answered
    envs: dict[str, str] = field(default_factory=dict)  # defaults for every command run in it
    metadata: dict[str, str] = field(default_factory=dict)  # caller's labels, returned as given
    isolation: SandboxOptions = field(default_factory=SandboxOptions)  # network and resource limits
    deadline_s: float | None = None  # the caller waits no longer: children not answering by then are dropped
    owner: str | None = None  # the driver's label, stored with each child: its children are listed and reaped by it


@dataclass
class ForkOutcome:
    """One child of a fork request: either a sandbox or the reason it failed, and where its time went."""

    index: int = 0  # the child's place in its request
    sandbox: dict[str, Any] | None = None
    error: str | None = None
    seconds_to_answer: float | None = None
    timings: dict[str, float] = field(default_factory=dict)  # ms per spawn stage (runtime/timings.py)


class SandboxService:
    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, snapshots: SnapshotService,
                 metrics: Metrics, isolation: Isolation, options: RuntimeOptions | None = None) -> None:
        self.paths = paths
        self.metrics = metrics
        self.registry = registry
        self.vmm = vmm
        self.snapshots = snapshots
        self.options = options or RuntimeOptions()
        self.isolation = isolation
        # Per-sandbox resources beyond files and record, freed by id (each runs in a worker thread).
        self.releasers: list[Releaser] = [self._release_isolation]
        self._live: dict[str, LiveSandbox] = {}
        self._ended: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._forking: Counter[str] = Counter()  # children being restored, per snapshot tag
        self._restoring = 0
        self._killers: set[asyncio.Task[None]] = set()  # kills started by a callback, kept until done
        self._restore_slots = asyncio.Semaphore(self.options.restore_slots())
        self._batches: set[asyncio.Future[Any]] = set()
        self.pool = PoolService(paths, registry, vmm, snapshots.store, isolation, self.release, new_sandbox_id,
                                self.options.pool_sizes, warm=self.options.warm_pools)

    async def fork(self, tag: str, count: int, options: ForkOptions = ForkOptions()) -> list[ForkOutcome]:
        """Restore ``count`` children of snapshot ``tag``; per-child outcome, in request order."""
        outcomes: list[ForkOutcome | None] = [None] * count
        async for outcome in await self.start_fork(tag, count, options):
            outcomes[outcome.index] = outcome
        return [o for o in outcomes if o is not None]

    async def start_fork(self, tag: str, count: int, options: ForkOptions = ForkOptions()) -> AsyncIterator[ForkOutcome]:
        """Start restoring ``count`` children of ``tag``; iterate the result for each one's outcome as it comes.

        A snapshot that cannot be forked raises here, before any child starts.

        Every child gets an outcome, whatever a sibling raised: ids of children that started are
        never lost. Children take ready VMMs from the snapshot's pool first, then start their own;
        all queue for the restore slots (admission), and the pool is refilled once the batch is done.
        If the consumer stops early, the children still finish starting (``forkd ls`` shows them).
        """
        started = time.monotonic()
        deadline = None if options.deadline_s is None else started + options.deadline_s
        # Counted before the first await, so `rmi` of this tag is refused while its children start.
        self._forking[tag] += count
        try:
            record, saved, spec = await asyncio.to_thread(self.snapshots.store.open, tag)
        except BaseException:
            self._forking[tag] -= count
            raise
        members: list[Member | None] = [*self.pool.take(record.tag, count, options.isolation)]
        members += [None] * (count - len(members))
        done: asyncio.Queue[ForkOutcome] = asyncio.Queue()

        async def one(index: int, member: Member | None) -> None:
            timings = Timings(started)
            try:
                sandbox = await self._spawn(record.tag, saved, spec, options, timings, member, deadline)
            except (VmmError, AgentError, IsolationError, OSError, SandboxLimitReached, DeadlinePassed) as exc:
                self.metrics.spawn_failures.inc()
                done.put_nowait(ForkOutcome(index=index, error=str(exc), timings=timings.as_ms()))
                return
            except Exception as exc:  # a bug must not take the batch's other children with it
                log.exception("spawning a child of %s failed", tag)
                self.metrics.spawn_failures.inc()
                done.put_nowait(ForkOutcome(index=index, error=f"internal error: {type(exc).__name__}: {exc}",
                                            timings=timings.as_ms()))
                return
            finally:
                self._forking[tag] -= 1
            self.metrics.spawn_seconds.observe(timings.total)
            timings.observe(self.metrics.spawn_stage_seconds)
            done.put_nowait(ForkOutcome(index=index, sandbox=self.describe(sandbox), seconds_to_answer=timings.total,
                                        timings=timings.as_ms()))

        batch = asyncio.gather(*(one(i, m) for i, m in enumerate(members)))
        self._batches.add(batch)  # runs to the end even when nobody iterates any more
        batch.add_done_callback(lambda _: (self._batches.discard(batch), self.pool.refill(record.tag)))

        async def outcomes() -> AsyncIterator[ForkOutcome]:
            for _ in range(count):
                yield await done.get()

        return outcomes()

    async def _spawn(self, tag: str, saved: SavedVm, spec: BootSpec, options: ForkOptions, timings: Timings,
                     member: Member | None, deadline: float | None) -> LiveSandbox:
        limit = self.options.max_sandboxes
        if limit is not None and len(self._live) + self._restoring >= limit:
            if member is not None:
                self.pool.give_back(tag, member)
            raise SandboxLimitReached(f"the daemon runs its limit of {limit} sandboxes (max_sandboxes); kill some "
                                      "with `forkd kill` or raise the limit in the daemon's config")
        self._restoring += 1
        try:
            try:
                await asyncio.wait_for(self._restore_slots.acquire(), _remaining(deadline))
            except asyncio.TimeoutError:
                if member is not None:
                    self.pool.give_back(tag, member)
                raise DeadlinePassed(f"the request's deadline of {deadline - timings.start:.1f} s passed while this "  # type: ignore[operator]
                                     "child waited for a restore slot; fork fewer at once or give more time") from None
            try:
                timings.mark("queued")
                return await self._restore(tag, saved, spec, options, timings, member, deadline)
            finally:
                self._restore_slots.release()
        finally:
            self._restoring -= 1

    async def _restore(self, tag: str, saved: SavedVm, spec: BootSpec, options: ForkOptions, timings: Timings,
                       member: Member | None, deadline: float | None) -> LiveSandbox:
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
        try:
            if vm is None:
                prepared = await asyncio.to_thread(self.isolation.prepare, sandbox_id, options.isolation)
                timings.mark("isolation")
                try:
                    vm = await self.vmm.prepare_restore(sandbox_id, saved, spec, run_dir,
                                                        dataclasses.replace(prepared.setup(), on_stage=timings.mark))
                finally:
                    prepared.close_tap()
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
            await asyncio.to_thread(self.registry.add_sandbox, record)
            timings.mark("recorded")
        except BaseException:
            if agent is not None:
                await agent.close()
            if vm is not None:
                await self.vmm.kill(vm)
            await self.release(sandbox_id, run_dir)
            raise
        agent.on_roundtrip = lambda op, seconds: self.metrics.agent_roundtrip_seconds.labels(op).observe(seconds)
        live = self.watch(record, vm, agent, prepared)
        live.record.meta["timings"] = timings.as_ms()  # shown with the sandbox; the record has them up to "recorded"
        return live

    @staticmethod
    async def _reseed(vm: VmHandle, sandbox_id: str, timeout_s: float) -> AgentClient:
        """The first answer a child gives is to its reseed: nothing runs on a copied RNG or clock.

        ``timeout_s`` counts from this child's own restore, not from the request.
        """
        agent, reseeded = await connect_when_answering(vm, timeout_s, protocol.OP_RESEED, reseed_args(sandbox_id))
        await SandboxService._check_reseeded(agent, sandbox_id, reseeded)
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

    def watch(self, record: SandboxRecord, vm: VmHandle, agent: AgentClient,
              isolation: Prepared | None = None) -> LiveSandbox:
        """Serve a running child: a fresh one, or one re-adopted after a daemon restart (``isolation`` None)."""
        live = LiveSandbox(record=record, vm=vm, agent=agent, isolation=isolation)
        live.watcher = asyncio.create_task(self._watch(live))
        agent.on_violation = lambda detail: self._agent_violated(live, detail)
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

    async def expire_forever(self, interval_s: float = 1.0) -> None:
        """The daemon's deadline keeper: a sandbox outlives its timeout by at most ``interval_s``.

        It must outlive any error of one round, or no deadline would be enforced any more.
        """
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.expire()
            except Exception:
                log.exception("the deadline keeper's round failed; it goes on")

    async def bound_logs_forever(self, interval_s: float = LOG_CHECK_S, max_bytes: int = CONSOLE_MAX_BYTES) -> None:
        """Keep every live sandbox's console under ``max_bytes``: a guest writing its serial port
        without end must not fill the host's disk. Like the deadline keeper, no error ends it."""
        told: set[str] = set()  # sandboxes whose cut was logged (a VMM started without append=on is cut each round)
        while True:
            await asyncio.sleep(interval_s)
            handles = [s.vm for s in self.live()]
            try:
                cut = await asyncio.to_thread(lambda: [vm.name for vm in handles if vm.bound_logs(max_bytes)])
            except Exception:
                log.exception("bounding the sandboxes' consoles failed; trying again")
                continue
            for name in set(cut) - told:
                log.info("sandbox %s: its console passed %d bytes and was cut to its end", name, max_bytes)
            told = (told | set(cut)) & {vm.name for vm in handles}

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

    async def set_labels(self, sandbox_id: str, labels: dict[str, str]) -> None:
        """Replace a running sandbox's labels, in its record too, so a restarted daemon has them."""
        live = self.get(sandbox_id)
        live.record.meta["metadata"] = dict(labels)
        await asyncio.to_thread(self.registry.set_labels, sandbox_id, dict(labels))

    def count_of(self, tag: str) -> int:
        """Children of ``tag`` running or being restored."""
        return self._forking[tag] + sum(1 for s in self._live.values() if s.record.snapshot_tag == tag)

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

    async def detach_all(self) -> None:
        """Stop serving every child but leave its VMM running and its record in place, for the next daemon."""
        for live in self.live():
            if live.watcher is not None:
                live.watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await live.watcher
            await live.agent.close()
            close = getattr(live.vm.process, "close", None)  # an adopted VMM's pidfd
            if close is not None:
                close()
        self._live.clear()
