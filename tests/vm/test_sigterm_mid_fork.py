"""A real daemon stopped by SIGTERM in the middle of a fork: before it exits, every VMM it started is
killed, those of children still restoring (not yet in its live set) included, so none is left for the
next daemon's start-up recovery to find. VMMs are found by their run directory under this test's own
FORKD_HOME, never by a global pattern."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import vmm_processes_under
from test_faults import (
    Daemon,
    bake,
    host_state,
    own_home,
    running_records,
    serving,
    wait_until,
)

from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.vm
TAG = "sigterm"
CHILDREN = 8


@pytest.fixture(scope="module")
def sigterm_home() -> Iterator[Path]:
    yield from own_home("forkd-sigterm-")


@pytest.fixture
def daemon(sigterm_home: Path) -> Iterator[Daemon]:
    bake(sigterm_home, TAG, memory_mib=512, warm_modules=[])
    yield from serving(sigterm_home)


def test_sigterm_during_a_fork_leaves_no_vmm_running(daemon: Daemon, sigterm_home: Path) -> None:
    outcome: dict[str, object] = {}

    def fork() -> None:
        try:
            outcome["result"] = Controller(url=daemon.controller.url).fork(TAG, CHILDREN)
        except ForkdError as exc:
            outcome["error"] = exc

    forking = threading.Thread(target=fork)
    forking.start()
    # Stop the daemon once VMMs run but not every child has answered: some are mid-restore.
    wait_until(lambda: len(vmm_processes_under(sigterm_home / "sandboxes")) >= 2 or not forking.is_alive(),
               bound_s=300)
    answered = running_records(sigterm_home)
    daemon.stop()  # SIGTERM, waits for the process to exit
    forking.join(timeout=60)
    left = host_state(sigterm_home)
    print(f"\nSIGTERM with {answered} of {CHILDREN} children answered: {left['vmms']} VMMs, "
          f"{len(left['run_dirs'])} run directories, {len(left['records'])} records left")
    assert answered < CHILDREN, "the fork ended before the stop: nothing was in flight"
    assert vmm_processes_under(sigterm_home) == [], daemon.log_tail()
    assert left["run_dirs"] == [] and left["records"] == []
