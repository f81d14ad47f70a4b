"""Pool bookkeeping without VMs: fill to size, take, give back, trim, discard on rmi, stop; nothing leaks.

The first tests use stand-ins for the VMM and snapshot store behind the calls the pool makes (cold
members), the last the FakeVmm through the whole runtime, warm and cold; tests/vm/test_pool_vm.py runs
the real thing.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
from test_runtime_fake_vmm import _image, _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.config import Paths
from forkd.host.netpolicy import NetRequest
from forkd.guest import protocol
from forkd.runtime.isolation import Isolation, SandboxOptions
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.pool import PoolService
from forkd.runtime.recovery import recover
from forkd.store.registry import Registry
from forkd.runtime.runtime import Runtime
from forkd.runtime.snapshots import SnapshotRequest
from forkd.vmm.base import MemoryStats, VmHandle
from forkd.vmm.fake import FakeBehaviour, FakeVmm


class Process:
    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    async def wait(self) -> int:
        return self.returncode or 0

    def kill(self) -> None:
        self.returncode = -9


class StandInVmm:
    def __init__(self) -> None:
        self.pids = itertools.count(1000)
        self.running: set[str] = set()
        self.gate: asyncio.Event | None = None  # when set, VMM starts wait for it

    async def prepare_restore(self, name, saved, spec, run_dir, setup) -> VmHandle:
        self.running.add(name)
        if self.gate is not None:
            await self.gate.wait()
        return VmHandle(name=name, run_dir=run_dir, process=Process(next(self.pids)), agent_socket=run_dir / "a")

    async def kill(self, vm: VmHandle) -> None:
        vm.process.kill()
        self.running.discard(vm.name)

    def memory_stats(self, vm: VmHandle) -> MemoryStats:
        return MemoryStats(rss_kib=10, pss_kib=8, private_dirty_kib=6)


class Snapshots:
    def open(self, tag: str):
        return None, "saved", "spec"


@pytest.fixture
def pool(tmp_path: Path):
    paths = Paths(home=tmp_path, cache=tmp_path / "cache", socket=tmp_path / "forkd.sock")
    paths.sandboxes.mkdir(parents=True)
    registry = Registry(paths.db)
    vmm = StandInVmm()
    released: list[str] = []

    async def release(sandbox_id: str, run_dir: Path) -> None:
        released.append(sandbox_id)
        run_dir.rmdir()

    ids = (f"sb-{i:012d}" for i in itertools.count())
    service = PoolService(paths, registry, vmm, Snapshots(), Isolation(registry, None, None, None),  # type: ignore[arg-type]
                          release, lambda: next(ids), configured={"cfg": 1}, warm=False)
    return service, vmm, released, registry


async def settle(service: PoolService) -> None:
    for _ in range(500):  # bounded: worker-thread hops take a moment
        await asyncio.sleep(0.01)
        if all(task.done() for task in service._fillers.values()) and not service._disposing:
            return


def test_a_member_that_finishes_starting_after_the_size_was_lowered_is_not_kept(pool) -> None:
    """A warm member takes a second or more to start; a pool emptied meanwhile must stay empty."""
    service, vmm, released, _ = pool

    async def run() -> None:
        vmm.gate = asyncio.Event()
        await service.set_size("hot", 1)
        for _ in range(500):  # bounded: until the member's VMM start is under way
            if service.describe("hot")["starting"] == 1 and vmm.running:
                break
            await asyncio.sleep(0.01)
        await service.set_size("hot", 0)
        vmm.gate.set()
        await settle(service)
        assert service.describe("hot")["ready"] == 0 and vmm.running == set() and len(released) == 1

    asyncio.run(run())


def test_fill_take_give_back_trim_discard_stop(pool) -> None:
    service, vmm, released, registry = pool

    async def run() -> None:
        await service.set_size("hot", 3)
        await settle(service)
        assert service.describe("hot")["ready"] == 3 and len(vmm.running) == 3
        assert service.describe("hot")["memory"]["private_dirty_kib"] == 18
        assert service.take("hot", 2, SandboxOptions(net=NetRequest(mode="nat"))) == []  # options differ: none
        taken = service.take("hot", 5, SandboxOptions())
        assert len(taken) == 3 and service.describe("hot")["ready"] == 0
        service.give_back("hot", taken.pop())  # its child did not start: it waits again
        assert service.describe("hot")["ready"] == 1
        service.refill("hot")
        await settle(service)
        assert service.describe("hot")["ready"] == 3
        await service.set_size("hot", 1)  # lowered: the extra members die at once
        await settle(service)
        assert service.describe("hot")["ready"] == 1 and len(released) == 2
        assert registry.pool_sizes() == {"hot": 1}
        await service.discard("hot")  # rmi
        await settle(service)
        assert service.describe("hot")["ready"] == 0 and "hot" not in registry.pool_sizes()
        await service.start()  # the config's pool
        await settle(service)
        assert [p["tag"] for p in service.list()] == ["cfg"]
        await service.stop()
        assert service.list()[0]["ready"] == 0 and vmm.running == {t.vm.name for t in taken}

    asyncio.run(run())


def test_a_refill_waits_while_a_fork_starts_children_and_starts_one_member_at_a_time(pool) -> None:
    """Refills never take CPU from the forks they serve: no member starts while a child of a fork is
    starting, and across pools one member starts at a time."""
    service, vmm, _, _ = pool

    async def run() -> None:
        with service.serving():  # a fork is starting a child
            await service.set_size("hot", 2)
            await service.set_size("warm", 2)
            await asyncio.sleep(0.2)
            assert vmm.running == set() and service.describe("hot")["starting"] == 0
        vmm.gate = asyncio.Event()
        for _ in range(500):  # bounded: until a member's VMM start is under way
            if vmm.running:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert len(vmm.running) == 1  # the other pool waits for the slot
        with service.serving():  # a fork arrives while a member starts: it finishes, no next one starts
            vmm.gate.set()
            await asyncio.sleep(0.2)
            assert len(vmm.running) == 1
        await settle(service)
        assert service.describe("hot")["ready"] == 2 and service.describe("warm")["ready"] == 2
        await service.stop()

    asyncio.run(run())


def test_sizes_are_bounded(pool) -> None:
    service = pool[0]
    with pytest.raises(ValueError):
        asyncio.run(service.set_size("hot", 33))


@pytest.mark.parametrize("warm", [True, False])
def test_forks_take_the_pool_first_and_a_crashed_daemon_leaves_nothing(tmp_path: Path, warm: bool) -> None:
    """On the FakeVmm (real processes, registry, guest protocol): pooled children, then recovery reaps members."""
    async def scenario() -> None:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm, options=RuntimeOptions(warm_pools=warm))
        pool = runtime.pools
        await pool.set_size("base", 2)
        await settle(pool)
        members = set(pool.describe("base")["members"])
        assert len(members) == 2 and pool.describe("base")["warm"] is warm
        idle = [m.vm for m in pool._members["base"]]
        if warm:  # state loaded, the first calls run (a scratch context, created and deleted), then stopped
            assert all(vmm.paused(vm) for vm in idle)
            for member in members:
                ops = [op for name, op in vmm.requests if name == member]
                assert ops == [protocol.OP_RESEED, protocol.OP_PING, protocol.OP_CONTEXTS_CREATE, protocol.OP_EVAL,
                               protocol.OP_RUN_CODE, protocol.OP_CONTEXTS_DELETE, protocol.OP_PING]
        else:  # no guest code has run
            assert not any(name in members for name, _ in vmm.requests)
        children = [o async for o in await runtime.spawner.start_fork("base", 3)]  # one more than the pool
        assert all(o.sandbox is not None for o in children), [o.error for o in children]
        pooled = {o.sandbox["id"] for o in children if "pool" in o.timings}  # type: ignore[index]
        assert pooled == members and sorted(o.index for o in children) == [0, 1, 2]
        assert all([s for s in o.timings if s != "total"][-2:] == ["reseed", "recorded"] for o in children)
        for child in children:  # every child, pooled or not, answered its own reseed last
            assert [op for name, op in vmm.requests if name == child.sandbox["id"]][-1] == protocol.OP_RESEED  # type: ignore[index]
        pooled_stages = [s for o in children if o.sandbox["id"] in members for s in o.timings]  # type: ignore[index]
        assert ("state_loaded" in pooled_stages) is not warm  # a warm member's state was loaded before the fork
        assert not any(vmm.paused(vm) for vm in idle)
        await settle(pool)
        assert pool.describe("base")["ready"] == 2  # refilled once the batch was done
        leftovers = set(pool.describe("base")["members"])
        # The daemon dies (nothing stopped, its children's VMMs run on): a new one adopts the children and
        # reaps the members (run directories without a record).
        await runtime.sandboxes.detach_all()
        restarted = await Runtime.open(runtime.paths, FakeVmm())
        recovered = await recover(restarted.sandboxes, restarted.store)
        assert leftovers <= set(recovered.reaped)
        assert not any((runtime.paths.sandboxes / m).exists() for m in leftovers)
        await restarted.stop()  # kills what it adopted, each released once, before its registry closes
        runtime.registry.close()

    run(scenario)



def test_a_pool_set_while_a_fork_starts_fills_once_its_children_answered(tmp_path: Path) -> None:
    """On the FakeVmm through the runtime: the spawner holds refills off while its children start."""
    async def scenario() -> None:
        vmm = FakeVmm(FakeBehaviour(reseed_delay_s=0.5))
        runtime = await _runtime(tmp_path, vmm, options=RuntimeOptions(warm_pools=False))
        try:
            outcomes = await runtime.spawner.start_fork("base", 2)
            await runtime.pools.set_size("base", 1)
            await asyncio.sleep(0.3)  # the children are still waiting for their reseed answer
            assert runtime.pools.describe("base")["starting"] == 0 and runtime.pools.describe("base")["ready"] == 0
            assert all([o.sandbox is not None async for o in outcomes])
            await settle(runtime.pools)
            assert runtime.pools.describe("base")["ready"] == 1
        finally:
            await runtime.stop()

    run(scenario)


class Baking(FakeVmm):
    """A FakeVmm whose parents write ``content`` at the start of their RAM: snapshots that differ."""

    content = b"old"

    async def boot(self, name: str, spec: Any, run_dir: Path, base_disk: Path, memory: Path) -> VmHandle:
        vm = await super().boot(name, spec, run_dir, base_disk, memory)
        self.write_guest_memory(vm, 0, self.content)
        return vm


@pytest.mark.parametrize("warm", [True, False])
def test_unpack_force_over_a_pooled_tag_replaces_its_members(tmp_path: Path, warm: bool) -> None:
    """Members map the snapshot their tag named when they started: after `unpack --force` over the tag
    the old ones are gone and the next fork gets the new snapshot's memory, pooled or not."""
    async def scenario() -> None:
        vmm = Baking()
        runtime = await _runtime(tmp_path, vmm, options=RuntimeOptions(warm_pools=warm))
        try:
            vmm.content = b"new"
            await runtime.snapshots.create(SnapshotRequest(tag="fresh", memory_mib=1, warm_modules=()),
                                           _image(tmp_path), lambda _line: None)
            pack = tmp_path / "fresh.tar.zst"
            await runtime.packs.pack("fresh", pack, False, lambda _line: None)
            pool = runtime.pools
            await pool.set_size("base", 2)
            await settle(pool)
            old = list(pool._members["base"])
            assert len(old) == 2

            await runtime.packs.unpack(pack, "base", True, lambda _line: None)
            await settle(pool)

            assert all(not m.alive for m in old)
            assert not {m.sandbox_id for m in old} & set(pool.describe("base")["members"])
            assert not any(m.vm.run_dir.exists() for m in old)
            assert pool.describe("base")["ready"] == 2  # refilled, keeping its size
            children = await runtime.spawner.fork("base", 3)  # two pooled, one restored afresh
            assert all(o.sandbox is not None for o in children), [o.error for o in children]
            assert sum("pool" in o.timings for o in children) == 2
            for child in children:
                ram = Path(runtime.sandboxes.get(child.sandbox["id"]).vm.state["ram"])  # type: ignore[index]
                assert ram.read_bytes()[:3] == b"new", child.sandbox
        finally:
            await runtime.stop()

    run(scenario)
