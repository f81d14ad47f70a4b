"""A loop of E2B snapshots on real guests keeps a bounded chain and loses nothing: the unmodified E2B
Python SDK, pointed at the session daemon's E2B front (tests/conftest.py runs it with ``[limits]
max_chain_depth = 3``), starts a sandbox from the last snapshot, writes a file, snapshots it, and
starts the next round from that snapshot, 6 times; the daemon's own snapshot info gives each depth,
and every round's files are in the last sandbox."""

from __future__ import annotations

import pytest

from conftest import SUITE_MAX_CHAIN_DEPTH
from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm

ROUNDS = 6


def test_snapshot_of_a_sandbox_made_from_a_snapshot_in_a_loop_keeps_the_chain_bounded(
        daemon: Controller, snapshot_tag: str, e2b_sdk: None) -> None:
    from e2b import Sandbox

    template, depths, snapshots = snapshot_tag, [], []
    for n in range(ROUNDS):
        sbx = Sandbox.create(template=template, timeout=600)
        try:
            sbx.files.write(f"/root/round-{n}", f"disk {n}")
            sbx.files.write(f"/tmp/round-{n}", f"tmpfs {n}")
            template = sbx.create_snapshot().snapshot_id
        finally:
            sbx.kill()
        snapshots.append(template)
        depths.append(daemon.snapshot(template)["depth"])
    sbx = Sandbox.create(template=template, timeout=600)
    try:
        for n in range(ROUNDS):
            assert sbx.files.read(f"/root/round-{n}") == f"disk {n}"
            assert sbx.files.read(f"/tmp/round-{n}") == f"tmpfs {n}"
    finally:
        sbx.kill()
        for tag in reversed(snapshots):
            Sandbox.delete_snapshot(tag)
    # Without the bound the depths are 1, 2, ..., 6; with it never past 3, a standalone layer every fourth.
    assert max(depths) <= SUITE_MAX_CHAIN_DEPTH and 0 in depths, depths
