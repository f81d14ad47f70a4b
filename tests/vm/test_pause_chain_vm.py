"""E2B pause/resume cycles on real guests keep a bounded chain of layers and lose nothing: the unmodified
E2B Python SDK, pointed at the session daemon's E2B front (tests/conftest.py runs it with
``[limits] max_chain_depth = 3``), pauses and resumes one sandbox 12 times; after every pause the daemon's
own snapshot info says how deep the chain it will resume from is, and after every resume the files, a
background process and the shell's history of cycles are there."""

from __future__ import annotations

import pytest

from conftest import SUITE_MAX_CHAIN_DEPTH
from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm

CYCLES = 12


def test_twelve_pauses_keep_the_chain_bounded_and_every_kind_of_state(
        daemon: Controller, snapshot_tag: str, e2b_sdk: None) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(template=snapshot_tag, timeout=900)
    try:
        sbx.files.write("/tmp/in-memory", "tmpfs state")
        sbx.files.write("/root/on-disk", "disk state")
        sleeper = sbx.commands.run("sleep 100000 >/dev/null 2>&1 & echo $!").stdout.strip()
        depths = []
        for cycle in range(CYCLES):
            sbx.commands.run(f"echo {cycle} >> /root/cycles")
            assert sbx.pause() is True
            snapshot = daemon.snapshot(daemon.workspace(sbx.sandbox_id)["snapshot_tag"])
            depths.append(snapshot["depth"])
            sbx = Sandbox.connect(sbx.sandbox_id, timeout=900)
            assert sbx.files.read("/tmp/in-memory") == "tmpfs state"
            assert sbx.files.read("/root/on-disk") == "disk state"
            assert sbx.commands.run(f"kill -0 {sleeper}").exit_code == 0  # the process lives on
            assert sbx.files.read("/root/cycles").split() == [str(n) for n in range(cycle + 1)]
        # Without the bound the depths are 1, 2, ..., 12; with it never past 3, a standalone layer (depth 0,
        # written by the pause itself) every fourth pause.
        assert max(depths) <= SUITE_MAX_CHAIN_DEPTH and depths.count(0) >= 2, depths
    finally:
        sbx.kill()
