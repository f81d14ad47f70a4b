"""Idle children stopped and continued on their next request (runtime/idle.py) on the FakeVmm: real
processes and guest protocol, the fake's pause/resume standing for QMP stop/cont."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from conftest import run_bounded, short_tmp_dir
from forkd.cli.sandboxes import _sandbox_row
from forkd.config import Paths
from forkd.daemon.config import load_config
from forkd.guest import protocol
from forkd.guest.protocol import AGENT_VERSION
from forkd.image.store import Image
from forkd.runtime.agent_client import AgentUnavailable
from forkd.runtime.idle import RUNNING, STOPPED
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.recovery import recover
from forkd.runtime.runtime import Runtime
from forkd.runtime.sandboxes import LiveSandbox
from forkd.runtime.snapshots import SnapshotRequest
from forkd.vmm.base import MemoryStats, VmHandle, VmmError
from forkd.vmm.fake import FakeVmm
from forkd.vmm.pageout import Pageout

T = TypeVar("T")
IDLE_S = 30.0  # never reached by waiting: a test moves a child's last request back past it


def run(make: Callable[[], Awaitable[T]]) -> T:
    return run_bounded(make, 30.0)  # type: ignore[no-any-return]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_tmp_dir("fki-") as directory:
        yield directory


async def _runtime(tmp_path: Path, vmm: FakeVmm, idle_s: float = IDLE_S) -> Runtime:
    paths = Paths(home=tmp_path / "home", cache=tmp_path / "cache", socket=tmp_path / "forkd.sock")
    runtime = await Runtime.open(paths, vmm, RuntimeOptions(idle_stop_s=idle_s))
    image_dir = tmp_path / "image"
    image_dir.mkdir(exist_ok=True)
    for name in ("vmlinuz", "initrd.img", "rootfs.ext4"):
        (image_dir / name).write_bytes(name.encode())
    image = Image(name="default", key="k", path=image_dir, kernel=image_dir / "vmlinuz",
                  initrd=image_dir / "initrd.img", rootfs=image_dir / "rootfs.ext4", kernel_version="6.12",
                  kernel_sha256="0" * 64, agent_version=AGENT_VERSION, created_at=0.0, size_bytes=3,
                  disk_size_mib=1, spec={}, inputs={})
    await runtime.snapshots.create(SnapshotRequest(tag="base", memory_mib=1), image, lambda _line: None)
    return runtime


async def _child(runtime: Runtime) -> LiveSandbox:
    [outcome] = await runtime.spawner.fork("base", 1)
    assert outcome.sandbox is not None, outcome.error
    return runtime.sandboxes.get(outcome.sandbox["id"])


def _idle_for_long(live: LiveSandbox) -> None:
    live.agent.last_request -= IDLE_S + 1


def _ops(vmm: FakeVmm, live: LiveSandbox) -> list[str]:
    return [op for name, op in vmm.requests if name == live.record.id]


def test_an_idle_child_is_stopped_and_its_next_request_continues_it_with_its_clock_set(tmp_path: Path) -> None:
    async def scenario() -> None:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm)
        try:
            live = await _child(runtime)
            assert await runtime.sandboxes.idle.sweep() == []  # it just answered its reseed
            _idle_for_long(live)
            assert await runtime.sandboxes.idle.sweep() == [live.record.id]
            assert vmm.paused(live.vm)
            assert runtime.sandboxes.describe(live)["vm_state"] == STOPPED
            assert b"forkd_sandboxes_idle_stopped 1.0" in runtime.metrics.exposition()
            await runtime.sessions.eval(live.record.id, "1 + 1")
            assert not vmm.paused(live.vm)
            assert runtime.sandboxes.describe(live)["vm_state"] == RUNNING
            assert _ops(vmm, live)[-3:] == [protocol.OP_ACTIVITY, protocol.OP_CLOCK_SET, protocol.OP_EVAL]
            assert [name for name, _ in vmm.clock_sets] == [live.record.id]
            assert b"forkd_sandboxes_idle_stopped 0.0" in runtime.metrics.exposition()
        finally:
            await runtime.stop()

    run(scenario)


def test_a_request_arriving_while_the_stop_is_in_flight_waits_for_it_then_continues(tmp_path: Path) -> None:
    class SlowStop(FakeVmm):
        def __init__(self) -> None:
            super().__init__()
            self.stopping = asyncio.Event()
            self.finish = asyncio.Event()

        async def pause(self, vm: VmHandle) -> None:
            self.stopping.set()
            await self.finish.wait()
            await super().pause(vm)

    async def scenario() -> None:
        vmm = SlowStop()
        runtime = await _runtime(tmp_path, vmm)
        try:
            live = await _child(runtime)
            _idle_for_long(live)
            sweep = asyncio.create_task(runtime.sandboxes.idle.sweep())
            await vmm.stopping.wait()  # the guest said it is idle; `stop` is on its way
            request = asyncio.create_task(runtime.sessions.eval(live.record.id, "2"))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not request.done() and protocol.OP_EVAL not in _ops(vmm, live)
            vmm.finish.set()
            assert await sweep == [live.record.id]
            await request
            assert not vmm.paused(live.vm)
            assert _ops(vmm, live)[-2:] == [protocol.OP_CLOCK_SET, protocol.OP_EVAL]
        finally:
            vmm.finish.set()
            await runtime.stop()

    run(scenario)


def test_a_child_with_work_of_its_own_or_a_request_in_flight_is_not_stopped(tmp_path: Path) -> None:
    async def scenario() -> None:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm)
        try:
            busy, waiting = await _child(runtime), await _child(runtime)
            vmm.behaviour.busy.add(busy.record.id)  # a background process or a server in its guest
            _idle_for_long(busy)
            assert await runtime.sandboxes.idle.sweep() == []
            assert protocol.OP_ACTIVITY in _ops(vmm, busy) and not vmm.paused(busy.vm)
            assert await runtime.sandboxes.idle.sweep() == []
            assert _ops(vmm, busy).count(protocol.OP_ACTIVITY) == 1  # asked again only after another idle time

            await vmm.pause(waiting.vm)  # its guest does not answer: a request stays in flight
            pending = asyncio.create_task(runtime.sessions.eval(waiting.record.id, "3"))
            while waiting.agent.in_flight == 0:
                await asyncio.sleep(0)
            _idle_for_long(waiting)
            assert await runtime.sandboxes.idle.sweep() == []
            await vmm.resume(waiting.vm)
            await pending
            assert runtime.sandboxes.describe(waiting)["vm_state"] == RUNNING
        finally:
            await runtime.stop()

    run(scenario)


def test_no_child_is_stopped_when_idle_stops_are_off(tmp_path: Path) -> None:
    async def scenario() -> None:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm, idle_s=0)
        try:
            live = await _child(runtime)
            _idle_for_long(live)
            assert await runtime.sandboxes.idle.sweep() == []
            assert not vmm.paused(live.vm) and protocol.OP_ACTIVITY not in _ops(vmm, live)
        finally:
            await runtime.stop()

    run(scenario)


def test_a_branch_of_a_stopped_child_continues_it_and_leaves_it_running(tmp_path: Path) -> None:
    async def scenario() -> tuple[Any, bool]:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm)
        try:
            live = await _child(runtime)
            _idle_for_long(live)
            await runtime.sandboxes.idle.sweep()
            assert vmm.paused(live.vm)
            record = await runtime.branches.branch(live.record.id, "b1", mode="diff")
            state = runtime.sandboxes.describe(live)["vm_state"]
            [fork] = await runtime.spawner.fork("b1", 1)  # and the branch forks
            assert fork.sandbox is not None, fork.error
            return (record.status, state), vmm.paused(live.vm)
        finally:
            await runtime.stop()

    assert run(scenario) == (("ready", RUNNING), False)


def test_a_restarted_daemon_continues_a_child_it_finds_stopped_and_sets_its_clock(tmp_path: Path) -> None:
    async def scenario() -> None:
        vmm = FakeVmm()
        first = await _runtime(tmp_path, vmm)
        live = await _child(first)
        _idle_for_long(live)
        assert await first.sandboxes.idle.sweep() == [live.record.id]
        await first.sandboxes.detach_all()  # the daemon goes; the stopped VMM stays
        first.registry.close()
        second = await Runtime.open(first.paths, vmm, RuntimeOptions(idle_stop_s=IDLE_S))
        try:
            recovery = await recover(second.sandboxes, second.store)
            assert recovery.adopted == [live.record.id]
            adopted = second.sandboxes.get(live.record.id)
            assert not vmm.paused(adopted.vm) and vmm.clock_sets[-1][0] == live.record.id
            assert second.sandboxes.describe(adopted)["vm_state"] == RUNNING
        finally:
            await second.stop()

    run(scenario)


def test_the_idle_time_comes_from_the_config_file_or_environment(tmp_path: Path) -> None:
    assert load_config(env={}).runtime_options.idle_stop_s == 60
    assert load_config(env={"FORKD_IDLE_STOP_S": "0"}).runtime_options.idle_stop_s == 0
    config = tmp_path / "forkd.toml"
    config.write_text("[sandboxes]\nidle_stop_s = 2.5\n")
    assert load_config(config, env={}).runtime_options.idle_stop_s == 2.5
    config.write_text("[sandboxes]\nidle_stop_s = -1\n")
    with pytest.raises(ValueError, match="idle_stop_s"):
        load_config(config, env={})
    assert load_config(env={}).runtime_options.idle_reclaim is True
    config.write_text("[sandboxes]\nidle_reclaim = false\n")
    assert load_config(config, env={}).runtime_options.idle_reclaim is False


class _Shrinking(FakeVmm):
    """Its VMMs' Private_Dirty: 40 MiB, then 1 MiB once read again (after a page-out)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def memory_stats(self, vm: VmHandle) -> MemoryStats:
        self.reads += 1
        return MemoryStats(rss_kib=0, pss_kib=0, private_dirty_kib=40960 if self.reads % 2 else 1024)


async def _stopped_with_swap(tmp_path: Path) -> tuple[Runtime, LiveSandbox]:
    """A runtime on a host that says it has swap, and a child of it just stopped for being idle."""
    runtime = await _runtime(tmp_path, _Shrinking())
    swaps = tmp_path / "swaps"
    swaps.write_text("Filename Type Size Used Priority\n/dev/zram9 partition 262140 0 100\n")
    runtime.sandboxes.idle.reclaim.swaps = swaps
    live = await _child(runtime)
    _idle_for_long(live)
    assert await runtime.sandboxes.idle.sweep() == [live.record.id]
    return runtime, live


async def _reclaims_done(runtime: Runtime) -> None:
    await asyncio.gather(*runtime.sandboxes.idle._reclaims)


def test_a_stopped_childs_memory_is_paged_out_and_listed_until_its_next_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paged: list[int] = []
    monkeypatch.setattr("forkd.runtime.reclaim.page_out",
                        lambda pid, stop, budget_s: paged.append(pid) or Pageout(39 << 20, True))

    async def scenario() -> None:
        runtime, live = await _stopped_with_swap(tmp_path)
        try:
            await _reclaims_done(runtime)
            assert paged == [live.vm.pid]
            assert runtime.sandboxes.describe(live)["reclaimed_kib"] == 40960 - 1024
            exposition = runtime.metrics.exposition()
            assert b"forkd_idle_reclaims_total 1.0" in exposition
            assert b"forkd_idle_reclaimed_bytes_total 4.0894464e+07" in exposition  # (40960 - 1024) KiB
            await runtime.sessions.eval(live.record.id, "1 + 1")
            assert "reclaimed_kib" not in runtime.sandboxes.describe(live)
        finally:
            await runtime.stop()

    run(scenario)


def test_a_request_to_a_child_being_paged_out_ends_the_page_out(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    started = threading.Event()

    def page_out(pid: int, stop: Callable[[], bool], budget_s: float) -> Pageout:
        started.set()
        deadline = time.monotonic() + 10
        while not stop():  # a call of a real page-out, one after another
            assert time.monotonic() < deadline, "the page-out was never told to stop"
            time.sleep(0.01)
        return Pageout(4096, False)

    monkeypatch.setattr("forkd.runtime.reclaim.page_out", page_out)

    async def scenario() -> None:
        runtime, live = await _stopped_with_swap(tmp_path)
        try:
            assert await asyncio.to_thread(started.wait, 10)
            await runtime.sessions.eval(live.record.id, "1 + 1")  # not held up by the page-out
            await _reclaims_done(runtime)
            state = runtime.sandboxes.describe(live)
            assert state["vm_state"] == RUNNING and "reclaimed_kib" not in state
        finally:
            await runtime.stop()

    run(scenario)


def test_a_request_to_a_stopped_child_that_cannot_be_continued_fails_as_on_a_lost_connection(tmp_path: Path) -> None:
    class BrokenCont(FakeVmm):
        async def resume(self, vm: VmHandle) -> None:
            raise VmmError("cont of a VMM that went away failed")

    async def scenario() -> None:
        vmm = BrokenCont()
        runtime = await _runtime(tmp_path, vmm)
        try:
            live = await _child(runtime)
            _idle_for_long(live)
            assert await runtime.sandboxes.idle.sweep() == [live.record.id]
            with pytest.raises(AgentUnavailable, match="continuing the stopped guest failed"):
                await runtime.sessions.eval(live.record.id, "1")
        finally:
            await runtime.stop()

    run(scenario)


def test_forkd_ls_shows_what_a_stopped_child_swapped() -> None:
    item = {"id": "sb-1", "snapshot_tag": "base", "status": "running", "pid": 7, "created_at": time.time(),
            "vm_state": STOPPED, "reclaimed_kib": 39 << 10}
    assert _sandbox_row(item)[3] == "idle_stopped, 39 MiB swapped"
    assert _sandbox_row({**item, "vm_state": RUNNING, "reclaimed_kib": None})[3] == "running"
