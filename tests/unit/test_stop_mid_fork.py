"""A daemon stopping in the middle of a fork: every VMM it started is killed before stop() returns,
whether its child reached the live set or not, and the fork's caller hears of each child."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import short_tmp_dir, vmm_processes_under
from test_runtime_fake_vmm import _runtime, run

from forkd.runtime.options import RuntimeOptions
from forkd.vmm.fake import FakeBehaviour, FakeVmm

CHILDREN = 6


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_tmp_dir("fks-") as directory:
        yield directory


@pytest.mark.parametrize("keep_on_stop", [False, True])
def test_stopping_mid_fork_kills_every_vmm_it_started(tmp_path: Path, keep_on_stop: bool) -> None:
    """Children whose VMM runs but whose guest has not answered its reseed (mid-restore), and children
    still waiting for a restore slot: none is in the live set, and none may outlive the stop
    (``keep_sandboxes_on_stop`` keeps live sandboxes only: a child without a record cannot be adopted)."""
    vmm = FakeVmm(FakeBehaviour(reseed_delay_s=60.0))
    sandboxes = tmp_path / "home" / "sandboxes"

    async def scenario() -> None:
        options = RuntimeOptions(max_concurrent_forks=3, keep_sandboxes_on_stop=keep_on_stop)
        runtime = await _runtime(tmp_path, vmm, options=options)
        outcomes = await runtime.spawner.start_fork("base", CHILDREN)
        while len(vmm_processes_under(sandboxes)) < 3:  # three restoring, three waiting for a slot
            await asyncio.sleep(0.02)
        assert runtime.sandboxes.live() == [] and runtime.spawner.starting() == CHILDREN
        await runtime.stop()
        assert vmm_processes_under(sandboxes) == []
        assert list(sandboxes.iterdir()) == []  # every run directory released
        heard = [outcome async for outcome in outcomes]
        assert len(heard) == CHILDREN and all(o.error is not None and "daemon is stopping" in o.error.message
                                              for o in heard)

    run(scenario)
    assert os.path.isdir(sandboxes)
