"""Runtime logic (fork, reseed, BRANCH, workspaces, recovery) on the FakeVmm: real registry, files,
processes and guest protocol, no virtual machine, so each test takes milliseconds of VMM time."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from conftest import run_bounded, short_tmp_dir
from forkd.config import Paths
from forkd.errors import Failure
from forkd.guest import protocol
from forkd.guest.protocol import AGENT_VERSION
from forkd.image.store import Image
from forkd.runtime import agent_client
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.recovery import recover
from forkd.store.errors import SnapshotConflict, SnapshotError
from forkd.store.registry import Registry, SandboxRecord, SnapshotRecord
from forkd.runtime.runtime import Runtime
from forkd.runtime.sandboxes import LiveSandbox, SandboxEnded
from forkd.runtime.snapshots import SnapshotRequest
from forkd.store.files import sha256_file
from forkd.store.layers import PAGE_SIZE
from forkd.vmm.base import Capabilities
from forkd.vmm.branching import BranchingUnsupported
from forkd.vmm.fake import FakeBehaviour, FakeVmm

T = TypeVar("T")
BOUND_S = 30.0  # every test is bounded; each takes well under a second


def run(make: Callable[[], Awaitable[T]]) -> T:
    return run_bounded(make, BOUND_S)  # type: ignore[no-any-return]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_tmp_dir("fkv-") as directory:
        yield directory


def _paths(tmp_path: Path) -> Paths:
    return Paths(home=tmp_path / "home", cache=tmp_path / "cache", socket=tmp_path / "forkd.sock")


def _image(tmp_path: Path) -> Image:
    directory = tmp_path / "image"
    directory.mkdir(exist_ok=True)
    for name in ("vmlinuz", "initrd.img", "rootfs.ext4"):
        (directory / name).write_bytes(name.encode())
    return Image(name="default", key="k", path=directory, kernel=directory / "vmlinuz",
                 initrd=directory / "initrd.img", rootfs=directory / "rootfs.ext4", kernel_version="6.12",
                 kernel_sha256="0" * 64, agent_version=AGENT_VERSION, created_at=0.0, size_bytes=3,
                 disk_size_mib=1, spec={}, inputs={})


async def _runtime(tmp_path: Path, vmm: FakeVmm, tag: str | None = "base",
                   options: RuntimeOptions | None = None) -> Runtime:
    runtime = await Runtime.open(_paths(tmp_path), vmm, options)
    if tag is not None:
        await runtime.snapshots.create(SnapshotRequest(tag=tag, memory_mib=1, warm_modules=("numpy",)),
                                       _image(tmp_path), lambda _line: None)
    return runtime


def test_a_warmed_snapshot_is_saved_with_its_default_context_forked(tmp_path: Path) -> None:
    """A child's first cell must not fork its context from the template first (a fork of the whole
    warm interpreter, hundreds of milliseconds under TCG): the parent does it before the save, without
    running a cell of its own in it (a context no cell ran in gets a child's reseed with its first cell
    instead of being woken by it)."""
    vmm = FakeVmm()

    async def run() -> None:
        runtime = await _runtime(tmp_path, vmm)
        await runtime.stop()

    asyncio.run(run())
    assert [op for name, op in vmm.requests if name.startswith("parent-")][-1:] == [protocol.OP_CONTEXTS_CREATE]
    assert vmm.evals == []


def test_the_runtime_is_wired_without_io_and_opened_explicitly(tmp_path: Path) -> None:
    """Constructing a Runtime only wires its services (nothing on disk, no state.db); ``Runtime.open`` makes
    the state directories and opens state.db, and the pool reads its stored sizes only when it starts."""
    paths = _paths(tmp_path)
    # A bare object as the registry: any read of it while wiring (the pool's sizes, say) would raise.
    Runtime(paths, FakeVmm(), registry=object(), isolation=object())  # type: ignore[arg-type]
    assert not paths.home.exists()

    async def scenario() -> tuple[bool, bool]:
        runtime = await Runtime.open(paths, FakeVmm())
        runtime.registry.close()
        return paths.db.is_file(), paths.sandboxes.is_dir()

    assert run(scenario) == (True, True)


def test_fork_spawns_distinct_reseeded_children(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[Any], list[str], list[Any]]:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm)
        try:
            outcomes = await runtime.spawner.fork("base", 3)
            records = runtime.registry.list_sandboxes()
            return outcomes, vmm.reseeds, records
        finally:
            await runtime.stop()

    outcomes, reseeds, records = run(scenario)
    ids = [o.sandbox["id"] for o in outcomes if o.sandbox]
    assert [o.error for o in outcomes] == [None, None, None]
    assert len(set(ids)) == 3 and sorted(reseeds) == sorted(ids)
    assert {r.status for r in records} == {"running"}
    assert all(r.vmm_state and r.vmm_state["ram"].endswith("/ram") for r in records)  # the backend's own state


def test_a_child_whose_kernel_rng_was_not_reseeded_fails_its_spawn(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[Any], list[Any], list[Path]]:
        vmm = FakeVmm(FakeBehaviour(kernel_rng_reseeded=False))
        runtime = await _runtime(tmp_path, vmm)
        try:
            outcomes = await runtime.spawner.fork("base", 2)
            return outcomes, runtime.sandboxes.live(), list(runtime.paths.sandboxes.iterdir())
        finally:
            await runtime.stop()

    outcomes, live, leftovers = run(scenario)
    assert [o.sandbox for o in outcomes] == [None, None]
    assert all(o.error.code == "reseed_failed" and "did not reseed its kernel RNG" in o.error.message for o in outcomes)
    assert live == [] and leftovers == []  # killed and released, nothing left behind


def test_a_child_that_answers_its_reseed_slowly_is_still_spawned(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each attempt waits longer than the last, so an agent slower than the first attempt is answered."""
    monkeypatch.setattr(agent_client, "FIRST_ATTEMPT_S", 0.1)

    async def scenario() -> list[Any]:
        runtime = await _runtime(tmp_path, FakeVmm(FakeBehaviour(reseed_delay_s=0.35)))
        try:
            return await runtime.spawner.fork("base", 1)
        finally:
            await runtime.stop()

    [outcome] = run(scenario)
    assert outcome.error is None and outcome.sandbox is not None


def test_a_failed_restore_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[Any], list[Any]]:
        runtime = await _runtime(tmp_path, FakeVmm(FakeBehaviour(fail_restore="state does not load")))
        try:
            return await runtime.spawner.fork("base", 1), runtime.registry.list_sandboxes()
        finally:
            await runtime.stop()

    outcomes, records = run(scenario)
    assert outcomes[0].error == Failure("vmm_error", "state does not load") and records == []


def test_a_child_failing_with_an_unexpected_error_keeps_its_siblings_ids(tmp_path: Path) -> None:
    """One child's bug (not a VmmError) must not lose the ids of the children that did start."""
    class SecondRestoreBreaks(FakeVmm):
        restores = 0

        async def complete_restore(self, vm: Any, saved: Any, on_stage: Any = None) -> None:
            self.restores += 1
            if self.restores == 2:
                raise RuntimeError("a bug in one child's restore")
            await super().complete_restore(vm, saved)

    async def scenario() -> tuple[list[Any], list[str], list[str]]:
        runtime = await _runtime(tmp_path, SecondRestoreBreaks())
        try:
            outcomes = await runtime.spawner.fork("base", 3)
            return (outcomes, sorted(r.id for r in runtime.registry.list_sandboxes()),
                    sorted(p.name for p in runtime.paths.sandboxes.iterdir()))
        finally:
            await runtime.stop()

    outcomes, records, run_dirs = run(scenario)
    started = sorted(o.sandbox["id"] for o in outcomes if o.sandbox)
    assert len(outcomes) == 3 and len(started) == 2
    assert [o.error for o in outcomes if o.sandbox is None] == [
        Failure("internal", "RuntimeError: a bug in one child's restore")]
    assert records == started and run_dirs == started  # the broken child was released, the others recorded


def test_a_workspace_whose_sandbox_ends_during_its_suspend_says_so(tmp_path: Path) -> None:
    """The sandbox reaching its timeout mid-suspend cuts the VMM's connections: that is a 409
    (sandbox_ended), not the connection error it surfaces as (a 500)."""
    async def scenario() -> tuple[BaseException | None, str]:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm)

        async def ended_mid_capture(vm: Any, *_: Any, **__: Any) -> Any:
            vm.process.kill()  # the deadline keeper's kill, as the capture runs
            raise ConnectionResetError(104, "Connection reset by peer")

        vmm.branching.capture = ended_mid_capture  # type: ignore[method-assign]
        try:
            await runtime.workspaces.create("notes", "base")
            try:
                await runtime.workspaces.suspend("notes")
            except Exception as exc:  # noqa: BLE001 - the error is what the test looks at
                return exc, runtime.workspaces.get("notes").state
            return None, runtime.workspaces.get("notes").state
        finally:
            await runtime.stop()

    error, state = run(scenario)
    assert isinstance(error, SandboxEnded) and "while it was being suspended" in str(error), repr(error)
    assert state == "running"  # nothing was saved; get() reports the workspace as lost


async def _written_source(tmp_path: Path, offset: int) -> tuple[Runtime, LiveSandbox]:
    """A runtime on the fake VMM and one child of "base" that wrote to its RAM at ``offset``."""
    vmm = FakeVmm()
    runtime = await _runtime(tmp_path, vmm)
    try:
        [outcome] = await runtime.spawner.fork("base", 1)
        source = runtime.sandboxes.get(outcome.sandbox["id"])
        vmm.write_guest_memory(source.vm, offset, b"written by the source")
    except BaseException:
        await runtime.stop()
        raise
    return runtime, source


def test_a_diff_branch_keeps_only_changed_pages_and_its_children_see_them(tmp_path: Path) -> None:
    async def scenario() -> tuple[SnapshotRecord, bytes]:
        runtime, source = await _written_source(tmp_path, 3 * PAGE_SIZE)
        try:
            disk_before = source.vm.state["disk"]
            record = await runtime.branches.branch(source.record.id, "b1", mode="diff")
            persisted = runtime.registry.get_sandbox(source.record.id)
            # What a restarted daemon adopts is the overlay the source writes now, not the frozen one.
            assert persisted is not None and persisted.vmm_state == source.vm.state
            assert source.vm.state["disk"] != disk_before
            [child] = await runtime.spawner.fork("b1", 1)
            vm = runtime.sandboxes.get(child.sandbox["id"]).vm
            with open(vm.state["ram"], "rb") as ram:
                ram.seek(3 * PAGE_SIZE)
                seen = ram.read(21)
            return record, seen
        finally:
            await runtime.stop()

    record, seen = run(scenario)
    assert record.meta["memory_kind"] == "diff" and record.meta["changed_pages"] == 1 and record.parent_tag == "base"
    assert seen == b"written by the source"


def _hold_after_answer(runtime: Runtime) -> threading.Event:
    """An event what a BRANCH does after its ``wait=False`` answer (its first step: linking the kernel
    and initrd) waits for: the snapshot stays ``writing`` until it is set."""
    go_on = threading.Event()
    link = runtime.store.digests.link

    def held(*args: Any) -> Any:
        assert go_on.wait(BOUND_S)
        return link(*args)

    runtime.store.digests.link = held  # type: ignore[method-assign]
    return go_on


def test_a_branch_not_waited_for_answers_after_its_pause_and_the_next_chains_on_it_while_it_is_written(
        tmp_path: Path) -> None:
    """``wait=False`` answers once the source runs again: what the source writes afterwards is not in the
    snapshot. A second capture does not wait for the first layer to be written; it chains onto it."""
    async def scenario() -> tuple[list[Any], bytes, bytes, bytes]:
        runtime, source = await _written_source(tmp_path, 3 * PAGE_SIZE)
        vmm = runtime.vmm
        assert isinstance(vmm, FakeVmm)
        written = _hold_after_answer(runtime)  # both stay `writing` until it is set
        try:
            first = await runtime.branches.branch(source.record.id, "w1", wait=False)
            seen = [first.status, first.parent_tag, vmm.branching.captures, "pause_ms" in first.meta]
            vmm.write_guest_memory(source.vm, 4 * PAGE_SIZE, b"after the first")
            second = await runtime.branches.branch(source.record.id, "w2", wait=False)
            seen += [second.status, second.parent_tag, vmm.branching.captures,
                     runtime.registry.get_snapshot("w1").status]  # type: ignore[union-attr]
            written.set()
            await runtime.branches.wait_all()
            seen += [runtime.registry.get_snapshot(tag).status for tag in ("w1", "w2")]  # type: ignore[union-attr]
            pages = []
            for tag in ("w1", "w2"):
                [child] = await runtime.spawner.fork(tag, 1)
                with open(runtime.sandboxes.get(child.sandbox["id"]).vm.state["ram"], "rb") as ram:
                    pages.append(ram.read(5 * PAGE_SIZE))
            return seen, pages[0][3 * PAGE_SIZE:3 * PAGE_SIZE + 21], pages[0][4 * PAGE_SIZE:4 * PAGE_SIZE + 15], \
                pages[1][4 * PAGE_SIZE:4 * PAGE_SIZE + 15]
        finally:
            await runtime.stop()

    seen, first_source_page, first_later_page, second_later_page = run(scenario)
    assert seen == ["writing", "base", 1, True, "writing", "w1", 2, "writing", "ready", "ready"]
    assert first_source_page == b"written by the source"
    assert first_later_page == bytes(15) and second_later_page == b"after the first"


def test_a_source_killed_right_after_a_branch_not_waited_for_still_gives_a_ready_snapshot(tmp_path: Path) -> None:
    """Snapshot, then kill (E2B's pause): the branch answered after the pause has already taken what it
    needs from the source's run directory (its frozen disk), so the kill cannot take it away."""
    async def scenario() -> tuple[str, bytes]:
        runtime, source = await _written_source(tmp_path, 3 * PAGE_SIZE)
        killed = _hold_after_answer(runtime)
        try:
            await runtime.branches.branch(source.record.id, "k1", wait=False)
            await runtime.sandboxes.kill(source.record.id)  # its run directory is removed
            killed.set()
            await runtime.branches.wait_all()
            [child] = await runtime.spawner.fork("k1", 1)
            with open(runtime.sandboxes.get(child.sandbox["id"]).vm.state["ram"], "rb") as ram:
                ram.seek(3 * PAGE_SIZE)
                return runtime.registry.get_snapshot("k1").status, ram.read(21)  # type: ignore[union-attr]
        finally:
            await runtime.stop()

    assert run(scenario) == ("ready", b"written by the source")


def test_a_failing_diff_command_keeps_only_the_tail_of_its_stderr(tmp_path: Path) -> None:
    """The guest decides how much a diff command writes to stderr: the daemon holds its last 4 KiB only."""
    flood = b"e" * (64 << 20) + b"\nthe real error\n"

    async def scenario() -> tuple[BaseException | None, int]:
        runtime = await _runtime(tmp_path, FakeVmm(FakeBehaviour(exec_stderr=flood, exec_exit_code=1)))
        tracemalloc.start()
        try:
            await runtime.branches.diff_exec("base", "layer", "make a mess", 10)
        except SnapshotError as exc:
            return exc, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            await runtime.stop()
        return None, 0

    error, peak = run(scenario)
    assert error is not None and str(error).endswith("the real error"), error
    assert peak < 40 << 20, peak  # a few 4 MiB frames in flight, never the 64 MiB


def test_a_full_branch_is_the_source_memory_hashed_once_and_a_changed_file_is_still_refused(tmp_path: Path) -> None:
    async def scenario() -> tuple[SnapshotRecord, SnapshotRecord, bytes, str, str]:
        runtime, source = await _written_source(tmp_path, 5 * PAGE_SIZE)
        try:
            record = await runtime.branches.branch(source.record.id, "f1", mode="full")
            ram = Path(source.vm.state["ram"]).read_bytes()
            memory = record.path / "memory"
            settled = await runtime.store.pending.settled("f1")  # hashed after publishing (store/pending.py)
            assert settled is not None
            opened = runtime.store.open("f1")[0].meta["sha256"]["memory"]
            os.chmod(memory, 0o600)
            with open(memory, "r+b") as f:
                f.seek(5 * PAGE_SIZE)
                f.write(b"tampered")
            with pytest.raises(Exception, match="memory was modified"):
                runtime.store.open("f1")
            return record, settled, ram, sha256_file(memory), opened
        finally:
            await runtime.stop()

    record, settled, ram, tampered, opened = run(scenario)
    assert record.meta["memory_kind"] == "full" and record.meta["changed_pages"] == 1
    assert record.meta["sha256"]["memory"] == "pending"  # the caller did not wait for it
    assert settled.meta["sha256"]["memory"] == hashlib.sha256(ram).hexdigest() == opened != tampered


def test_a_workspace_suspends_to_a_layer_and_resumes_with_its_memory(tmp_path: Path) -> None:
    async def scenario() -> tuple[str, str, bytes]:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm)
        try:
            record = await runtime.workspaces.create("notes", "base")
            vm = runtime.sandboxes.get(record.sandbox_id).vm
            vmm.write_guest_memory(vm, 0, b"kept across suspend")
            suspended = await runtime.workspaces.suspend("notes")
            resumed = await runtime.workspaces.resume("notes")
            with open(runtime.sandboxes.get(resumed.sandbox_id).vm.state["ram"], "rb") as ram:
                return suspended.state, resumed.state, ram.read(19)
        finally:
            await runtime.stop()

    suspended, resumed, memory = run(scenario)
    assert (suspended, resumed, memory) == ("suspended", "running", b"kept across suspend")


def test_a_restarted_daemon_adopts_answering_vmms_and_reaps_a_stalled_one(tmp_path: Path) -> None:
    """A previous daemon left two children running; one VMM's monitor stalls: it is killed and released."""

    async def scenario() -> tuple[list[str], list[str], list[str], bool]:
        behaviour = FakeBehaviour()
        vmm = FakeVmm(behaviour)
        first = await _runtime(tmp_path, vmm)
        outcomes = await first.spawner.fork("base", 2)
        kept, stalled = (o.sandbox["id"] for o in outcomes)
        stalled_process = first.sandboxes.get(stalled).vm.process
        await first.sandboxes.detach_all()  # the daemon goes; its VMMs stay
        first.registry.close()
        behaviour.stalled.add(stalled)
        second = await Runtime.open(first.paths, vmm)
        try:
            recovery = await recover(second.sandboxes, second.store)
            ids = [s.record.id for s in second.sandboxes.live()]
            # Recovery kills through a pidfd; this (first daemon's) handle learns of the exit when it reaps.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stalled_process.wait(), 10)
            return recovery.adopted, recovery.reaped, ids, stalled_process.returncode is not None
        finally:
            await second.stop()
            if stalled_process.returncode is None:
                stalled_process.kill()

    adopted, reaped, live, stalled_gone = run(scenario)
    assert len(adopted) == 1 and len(reaped) == 1 and live == adopted and stalled_gone


def test_recovery_finishes_whatever_one_record_raises(tmp_path: Path) -> None:
    """Recovery runs before the daemon serves: a VMM whose adoption raises something unexpected is
    reaped, and a record whose release fails is left for the next start; the others are recovered."""
    class AdoptBreaks(FakeVmm):
        broken: str = ""

        async def adopt(self, name: str, process: Any, run_dir: Path, state: dict[str, Any],
                        stopped_ok: bool = False) -> Any:
            if name == self.broken:
                raise RuntimeError("a bug while adopting")
            return await super().adopt(name, process, run_dir, state, stopped_ok)

    async def scenario() -> tuple[Any, list[str], list[str], bool]:
        behaviour = FakeBehaviour()
        vmm = AdoptBreaks(behaviour)
        first = await _runtime(tmp_path, vmm)
        ids = [o.sandbox["id"] for o in await first.spawner.fork("base", 3)]
        processes = {i: first.sandboxes.get(i).vm.process for i in ids}
        await first.sandboxes.detach_all()
        first.registry.close()
        kept, broken, unreleasable = ids
        vmm.broken = broken
        behaviour.stalled.add(unreleasable)
        second = await Runtime.open(first.paths, vmm)
        release = second.sandboxes.release

        async def failing_release(sandbox_id: str, run_dir: Path) -> None:
            if sandbox_id == unreleasable:
                raise OSError(5, "Input/output error")
            await release(sandbox_id, run_dir)

        second.sandboxes.release = failing_release  # type: ignore[method-assign]
        try:
            recovery = await recover(second.sandboxes, second.store)
            live = [s.record.id for s in second.sandboxes.live()]
            return recovery, live, ids, processes[broken].returncode is not None
        finally:
            await second.stop()
            for process in processes.values():
                if process.returncode is None:
                    process.kill()

    recovery, live, (kept, broken, unreleasable), broken_gone = run(scenario)
    assert (recovery.adopted, recovery.reaped, recovery.failed) == ([kept], [broken], [unreleasable])
    assert live == [kept] and broken_gone


def test_records_keep_the_backend_state_opaque(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state.db")
    registry.add_sandbox(SandboxRecord("sb-opaqueopaque", "base", "running", None, tmp_path, time.time()))
    registry.set_vmm("sb-opaqueopaque", 5, 6, {"anything": ["a", 1], "nested": {"x": None}})
    record = registry.get_sandbox("sb-opaqueopaque")
    assert record is not None and record.vmm_state == {"anything": ["a", 1], "nested": {"x": None}}
    registry.close()


class NoBranching(FakeVmm):
    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), branching=False)


def test_a_backend_without_branching_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, NoBranching())
        try:
            [outcome] = await runtime.spawner.fork("base", 1)
            await runtime.branches.branch(outcome.sandbox["id"], "b1")
        finally:
            await runtime.stop()

    with pytest.raises(BranchingUnsupported, match="fake VMM backend cannot branch"):
        run(scenario)


def test_a_backend_without_branching_compacts_through_its_disk_format(tmp_path: Path) -> None:
    """Flattening a disk is the disk format's job, which every backend has: compaction needs no BRANCH."""
    async def scenario() -> tuple[SnapshotRecord, list[str]]:
        runtime = await _runtime(tmp_path, NoBranching())
        try:
            flat = await runtime.compaction.compact("base", "flat")
            outcomes = await runtime.spawner.fork("flat", 1)
            return flat, [str(o.error) for o in outcomes if o.error]
        finally:
            await runtime.stop()

    flat, errors = run(scenario)
    assert errors == [] and flat.parent_tag is None
    assert set(flat.meta["sha256"]) == {"vmlinuz", "initrd.img", "base.ext4", "disk.fake", "memory", "state"}
    assert (flat.path / "disk.fake").read_bytes().startswith(b"fake disk over base.ext4\n")
    assert sorted(p.name for p in flat.path.glob("*.sock")) == []  # the backend's run-dir leftovers went with its bake


def test_a_daemon_killed_inside_a_branch_pause_leaves_its_source_running(tmp_path: Path) -> None:
    """`kill -9` of the daemon while BRANCH has its source stopped: the next daemon resumes the source
    (it answers) instead of reaping it, the half-made branch is failed and its build directory gone,
    and the source is not branched again (its disk may hold a layer no snapshot received)."""

    async def scenario() -> tuple[Any, ...]:
        vmm = FakeVmm()
        first = await _runtime(tmp_path, vmm)
        [outcome] = await first.spawner.fork("base", 1)
        source = outcome.sandbox["id"]  # type: ignore[index]
        live = first.sandboxes.get(source)
        # Where BRANCH stands inside its pause: the branch registered as writing, naming its source,
        # its build directory made, the source's guest stopped through the VMM seam.
        claim = first.store.claim("half", "branched")
        first.store.register_writing(claim, SnapshotRecord(
            tag="half", status="writing", image="default", path=first.paths.snapshots / "half",
            created_at=time.time(), meta={"mode": "diff", "source_sandbox": source}, parent_tag="base"))
        build = first.store.build_dir("half")
        await vmm.pause(live.vm)
        await first.sandboxes.detach_all()  # the daemon dies: nothing is cleaned up, its VMMs stay
        first.registry.close()
        second = await Runtime.open(first.paths, vmm)
        try:
            recovery = await second.start()
            ping = await second.sandboxes.get(source).agent.call(protocol.OP_PING, {}, timeout=5)
            with pytest.raises(SnapshotConflict, match="stopped while branching it to 'half'"):
                await second.branches.branch(source, "again")
            half = second.registry.get_snapshot("half")
            outcome = (recovery.adopted, recovery.resumed, ping["sandbox_id"], vmm.paused(live.vm),
                       half.status if half else None, build.exists(), second.registry.get_snapshot("again"))
            await second.sandboxes.detach_all()  # and the refusal outlives another restart
            second.registry.close()
            third = await Runtime.open(first.paths, vmm)
            try:
                assert (await third.start()).adopted == [source]
                with pytest.raises(SnapshotConflict, match="stopped while branching it to 'half'"):
                    await third.branches.branch(source, "again")
            finally:
                await third.stop()
            return outcome
        finally:
            if live.vm.process.returncode is None:
                live.vm.process.kill()

    adopted, resumed, answered, paused, half, build_left, again = run(scenario)
    assert adopted == [answered] and resumed == {answered: "half"} and not paused
    assert half == "failed" and not build_left and again is None
