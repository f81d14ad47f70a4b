"""Recognising and holding processes a previous daemon started, on real processes (pid reuse is real)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forkd.vmm.process import AdoptedProcess, cmdline, kill_pidfd, open_verified, processes_under, start_time


@pytest.fixture
def sleeper(tmp_path: Path):
    """A real process whose command line names a run directory, as a VMM's does."""
    run_dir = tmp_path / "sandboxes" / "sb-aaaaaaaaaaaa"
    run_dir.mkdir(parents=True)
    program = tmp_path / "fake-vmm"
    program.symlink_to(Path(sys.executable).resolve())
    process = subprocess.Popen([str(program), "-c", "import time; time.sleep(1000)", f"path={run_dir}/agent.sock"],
                               start_new_session=True)
    deadline = time.monotonic() + 10
    while str(run_dir).encode() not in cmdline(process.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the interpreter has replaced the forked test process
    yield process, run_dir
    process.kill()
    process.wait()


def test_processes_under_finds_only_the_program(sleeper, tmp_path: Path) -> None:
    process, run_dir = sleeper
    found = processes_under(tmp_path / "sandboxes", "fake-vmm")
    assert [(r.pid, r.directory) for r in found] == [(process.pid, run_dir.name)]
    assert found[0].started == start_time(process.pid)
    assert processes_under(tmp_path / "sandboxes", "qemu-system-x86_64") == []


def test_a_pid_with_another_start_time_is_not_trusted(sleeper) -> None:
    process, run_dir = sleeper
    started = start_time(process.pid)
    assert started is not None
    assert open_verified(process.pid, started + 1, f"{run_dir}/") is None, "same pid, other process: refused"
    assert open_verified(process.pid, started, "/some/other/dir/") is None
    pidfd = open_verified(process.pid, started, f"{run_dir}/")
    assert pidfd is not None
    assert kill_pidfd(pidfd, timeout_s=10)
    assert process.wait(timeout=10) == -signal.SIGKILL


def test_adopted_process_notices_exit_and_can_be_killed(sleeper) -> None:
    process, run_dir = sleeper

    async def scenario() -> int:
        pidfd = open_verified(process.pid, start_time(process.pid), f"{run_dir}/")
        assert pidfd is not None
        adopted = AdoptedProcess(process.pid, pidfd)
        waiter = asyncio.create_task(adopted.wait())
        await asyncio.sleep(0.05)
        assert not waiter.done() and adopted.returncode is None
        adopted.kill()
        return await asyncio.wait_for(waiter, 10)

    assert asyncio.run(scenario()) == -signal.SIGKILL
    process.wait(timeout=10)
    assert start_time(process.pid) is None
