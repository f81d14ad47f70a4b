"""Pools of ready VMMs per hot snapshot: a fork that takes one only continues it and reseeds it.

A member is a child's VMM started ahead of time for one snapshot with ``-incoming defer``: its run
directory (``sandboxes/<id>``), disk overlay, cgroup and a fresh vmgenid are made, a diff chain's
pages are laid into its RAM and its monitor is open. A *warm* member (the default) goes further:
it loads its state, runs a fork's first calls in the guest and is stopped (``runtime/warmup.py``),
so the guest code those calls run is already translated when a child needs it; a fork that takes
it continues it and reseeds it. A *cold* member (``warm_pools = false``) has run no guest code and
a fork loads its state first. Either way the reseed that makes RNGs, clock and hostname the child's
own comes after the fork takes it. Only forks with the default options (no network, no limits) can
use a member: the network namespace and cgroup limits are made before a VMM starts.

Members are refilled in the background once a fork is done with them, never on a caller's path and
never against one: a refill starts a member only while no fork is starting children (``serving``,
entered by the spawner around each child), and one member at a time across all pools, so the CPU a
VMM start and its warm-up take goes to forks first. A member has no registry record: a daemon that dies leaves its
run directory, which recovery reaps with the VMM in it (running, stopped or half-warmed) like a
child caught mid-restore; ``rmi``, daemon stop and a size lowered kill members at once. A draining
daemon pauses refills (``pause``): its idle members stay until it stops or is undrained.

A member belongs to the snapshot its tag named when it started: its RAM maps that snapshot's memory
file (a warm one has run on it). Publishing another snapshot under the tag (``unpack``/``pull
--force``) therefore goes through :meth:`PoolService.replacing`, which kills the members first, lets
none start while the tag is replaced and refills from what the tag names afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.runtime import warmup
from forkd.runtime.agent_client import AgentClient
from forkd.runtime.isolation import Isolation, Prepared, SandboxOptions
from forkd.store.errors import SnapshotError
from forkd.store.registry import Registry
from forkd.store.snapshots import SnapshotStore
from forkd.vmm.base import MemoryStats, Vmm, VmHandle, VmmError

MAX_POOL_SIZE = 32  # per snapshot; each idle member holds a QEMU process (docs/operations.md)
FILL_RETRY_S = 30.0  # after a member failed to start, wait this long before trying again
log = logging.getLogger("forkd.pool")

# Frees a sandbox's files and host resources by id (SandboxService.release, runtime/sandboxes.py).
Release = Callable[[str, Path], Awaitable[None]]
NewId = Callable[[], str]


@dataclass(eq=False)
class Member:
    """One ready VMM waiting for a fork."""

    sandbox_id: str
    vm: VmHandle
    prepared: Prepared
    ready_at: float
    agent: AgentClient | None = None  # a warm member's open agent connection; its guest is stopped
    generation: int = 0  # of its tag's pool when it started: a member of an older one is of a snapshot gone

    @property
    def alive(self) -> bool:
        return self.vm.process.returncode is None


def usable_by(options: SandboxOptions) -> bool:
    """Members are made with the default options; a child asking for more needs its own VMM."""
    return options == SandboxOptions()


class PoolService:
    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, snapshots: SnapshotStore,
                 isolation: Isolation, release: Release, new_id: NewId,
                 configured: dict[str, int] | None = None, warm: bool = True) -> None:
        self.paths = paths
        self.registry = registry
        self.vmm = vmm
        self.snapshots = snapshots
        self.isolation = isolation
        self._release = release
        self._new_id = new_id
        self.warm = warm  # members run a fork's first calls, then wait stopped (runtime/warmup.py)
        self._configured = dict(configured or {})  # sizes from the daemon's config file
        self._stored: dict[str, int] = {}  # sizes set through the API, written through to the registry (read at start)
        self._members: dict[str, list[Member]] = defaultdict(list)
        self._starting: Counter[str] = Counter()
        self._fillers: dict[str, asyncio.Task[None]] = {}
        self._disposing: set[asyncio.Task[None]] = set()
        self._generation: Counter[str] = Counter()  # bumped when a tag's pool is discarded
        self._replaced: set[str] = set()  # tags whose snapshot is being replaced: no member starts
        self._stopped = False
        self._paused = False  # draining: no member is started until ``resume``
        self._refill_slot = asyncio.Lock()  # one member starts at a time, whatever its pool
        self._serving = 0  # children of forks being started: refills wait for none
        self._no_fork = asyncio.Event()
        self._no_fork.set()

    # sizes

    def size(self, tag: str) -> int:
        """The target size: set through the API (kept in the registry), else the config file's, else 0."""
        stored = self._stored.get(tag)
        return stored if stored is not None else self._configured.get(tag, 0)

    async def set_size(self, tag: str, size: int) -> dict[str, Any]:
        """Keep ``size`` members of ``tag`` ready from now on (0 empties it); returns the pool's state."""
        if not 0 <= size <= MAX_POOL_SIZE:
            raise ValueError(f"a pool holds 0 to {MAX_POOL_SIZE} members, not {size}")
        await asyncio.to_thread(self.snapshots.open, tag)  # a tag that cannot fork gets no pool
        await asyncio.to_thread(self.registry.set_pool_size, tag, size)
        self._stored[tag] = size
        for member in self._members[tag][size:]:
            self._members[tag].remove(member)
            self._dispose(member)
        self.refill(tag)
        return self.describe(tag)

    async def start(self) -> None:
        """Fill every pool with a size (after recovery, so leftovers of a dead daemon are gone first)."""
        self._stored = {**await asyncio.to_thread(self.registry.pool_sizes), **self._stored}
        for tag in {*self._configured, *self._stored}:
            self.refill(tag)

    # members

    def take(self, tag: str, count: int, options: SandboxOptions) -> list[Member]:
        """Up to ``count`` ready members of ``tag`` for a fork with ``options``; the caller owns them."""
        if not usable_by(options):
            return []
        taken: list[Member] = []
        members = self._members[tag]
        while members and len(taken) < count:
            member = members.pop(0)
            if member.alive:
                taken.append(member)
            else:  # died while idle (OOM, killed from outside): release it and look further
                self._dispose(member)
        return taken

    def give_back(self, tag: str, member: Member) -> None:
        """A member taken for a child that then did not start (a limit, a deadline) waits again."""
        if member.alive and not self._stopped and member.generation == self._generation[tag]:
            self._members[tag].insert(0, member)
        else:
            self._dispose(member)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Around starting one child of a fork: no member starts meanwhile (one already starting finishes)."""
        self._serving += 1
        self._no_fork.clear()
        try:
            yield
        finally:
            self._serving -= 1
            if not self._serving:
                self._no_fork.set()

    def refill(self, tag: str) -> None:
        """Start filling ``tag``'s pool in the background, unless that already runs or it is full."""
        if self._stopped or self._paused or tag in self._replaced or \
                (tag in self._fillers and not self._fillers[tag].done()):
            return
        if len(self._members[tag]) + self._starting[tag] >= self.size(tag):
            return
        self._fillers[tag] = asyncio.get_running_loop().create_task(self._fill(tag))

    def _wants(self, tag: str) -> bool:
        return not self._stopped and not self._paused and tag not in self._replaced and \
            len(self._members[tag]) + self._starting[tag] < self.size(tag)

    async def _fill(self, tag: str) -> None:
        """Start members one at a time until the pool has its size, each once no fork is starting children:
        a refill takes one VMM start of CPU, and never while a fork needs it."""
        while self._wants(tag):
            failed: Exception | None = None
            async with self._refill_slot:
                while not self._no_fork.is_set():
                    await self._no_fork.wait()
                if not self._wants(tag):  # decided again: the pool may have changed while it waited
                    return
                try:
                    member = await self._start_member(tag)
                except (SnapshotError, VmmError, OSError, RuntimeError) as exc:
                    failed = exc
            if failed is not None:  # waited out without holding the slot: other pools fill meanwhile
                log.warning("pool of %s: a member failed to start (%s); trying again in %.0f s", tag, failed,
                            FILL_RETRY_S)
                await asyncio.sleep(FILL_RETRY_S)
                continue
            if self._stopped or member.generation != self._generation[tag] or len(self._members[tag]) >= self.size(tag):
                # rmi, stop, a replaced snapshot or a smaller size came while it started: the loop's
                # condition decides whether the pool still wants a member (of what the tag names now)
                self._dispose(member)
                continue
            self._members[tag].append(member)

    async def _start_member(self, tag: str) -> Member:
        generation = self._generation[tag]
        _, saved, spec = await asyncio.to_thread(self.snapshots.open, tag)
        sandbox_id = self._new_id()
        run_dir = self.paths.sandboxes / sandbox_id
        self._starting[tag] += 1
        vm: VmHandle | None = None
        try:
            run_dir.mkdir(parents=True)
            prepared = await asyncio.to_thread(self.isolation.prepare, sandbox_id, SandboxOptions())
            try:
                setup = prepared.setup()
                if self.warm:
                    setup = dataclasses.replace(setup, translation_cache_mib=warmup.TRANSLATION_CACHE_MIB)
                vm = await self.vmm.prepare_restore(sandbox_id, saved, spec, run_dir, setup)
            finally:
                prepared.close_tap()
            agent = await warmup.warm(self.vmm, vm, saved, sandbox_id) if self.warm else None
        except BaseException:
            if vm is not None:
                with contextlib.suppress(VmmError, OSError):
                    await self.vmm.kill(vm)
            await self._release(sandbox_id, run_dir)
            raise
        finally:
            self._starting[tag] -= 1
        return Member(sandbox_id=sandbox_id, vm=vm, prepared=prepared, ready_at=time.time(), agent=agent,
                      generation=generation)

    def _dispose(self, member: Member) -> None:
        """Kill a member's VMM and release what it held, in the background."""
        async def dispose() -> None:
            if member.agent is not None:
                await member.agent.close()
            with contextlib.suppress(VmmError, OSError):
                await self.vmm.kill(member.vm)
            await self._release(member.sandbox_id, member.vm.run_dir)

        task = asyncio.get_running_loop().create_task(dispose())
        self._disposing.add(task)
        task.add_done_callback(self._disposing.discard)

    def _drop_members(self, tag: str) -> None:
        """Kill ``tag``'s members; one still starting is killed when it is ready (its generation is old)."""
        self._generation[tag] += 1
        for member in self._members.pop(tag, []):
            self._dispose(member)

    async def discard(self, tag: str) -> None:
        """The snapshot is gone (``rmi``): kill its members, stop filling and forget its size."""
        self._drop_members(tag)
        self._configured.pop(tag, None)
        if self._stored.pop(tag, None) is not None:
            await asyncio.to_thread(self.registry.set_pool_size, tag, None)

    @contextlib.asynccontextmanager
    async def replacing(self, tag: str) -> AsyncIterator[None]:
        """Around publishing another snapshot under ``tag``: its members are killed first (a warm one
        would serve the old snapshot under the new tag, a cold one load the new state over the old
        memory), none starts meanwhile, and afterwards the pool refills, keeping its size, from what
        ``tag`` names then (the new snapshot, or the old one put back when publishing failed)."""
        self._replaced.add(tag)
        self._drop_members(tag)
        try:
            yield
        finally:
            self._replaced.discard(tag)
            if not self._stopped:
                self.refill(tag)

    def pause(self) -> None:
        """Start no more members (the daemon drains); a member already starting finishes and waits."""
        self._paused = True

    def resume(self) -> None:
        """Fill every pool with a size again."""
        self._paused = False
        for tag in {*self._configured, *self._stored}:
            self.refill(tag)

    async def stop(self) -> None:
        """Kill every member and wait until all are released (daemon stop)."""
        self._stopped = True
        for task in self._fillers.values():
            task.cancel()
        await asyncio.gather(*self._fillers.values(), return_exceptions=True)
        for tag in list(self._members):
            for member in self._members.pop(tag):
                self._dispose(member)
        await asyncio.gather(*list(self._disposing), return_exceptions=True)

    # what operators see

    def describe(self, tag: str) -> dict[str, Any]:
        members = [m for m in self._members.get(tag, []) if m.alive]
        stats = [s for m in members if (s := self._memory(m)) is not None]
        return {"tag": tag, "size": self.size(tag), "warm": self.warm, "ready": len(members),
                "starting": self._starting[tag],
                "memory": {"rss_kib": sum(s.rss_kib for s in stats), "pss_kib": sum(s.pss_kib for s in stats),
                           "private_dirty_kib": sum(s.private_dirty_kib for s in stats)},
                "members": [m.sandbox_id for m in members]}

    def list(self) -> list[dict[str, Any]]:
        tags = {*self._configured, *self._stored, *(t for t, ms in self._members.items() if ms)}
        return [self.describe(tag) for tag in sorted(tags)]

    def _memory(self, member: Member) -> MemoryStats | None:
        try:
            return self.vmm.memory_stats(member.vm)
        except VmmError:
            return None
