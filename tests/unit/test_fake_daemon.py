"""A whole daemon process on the fake VMM backend (``vmm = "fake"``), driven through the SDK: what
clusters and clients are tested against on hosts without QEMU. The real entry point, config layering,
socket, SQLite, store and guest protocol; no VM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import fake_daemon_on
from forkd.sdk.controller import Controller


@pytest.fixture
def fake_daemon(fake_home: Path) -> Iterator[Controller]:
    with fake_daemon_on(fake_home) as controller:
        yield controller


def test_a_daemon_on_the_fake_backend_bakes_forks_branches_and_compacts(fake_daemon: Controller,
                                                                        fake_home: Path) -> None:
    assert fake_daemon.version()["vmm"] == "fake"
    fake_daemon.create_snapshot("base", memory_mib=1024, warm_modules=[])
    snapshot = fake_home / "snapshots" / "base"
    assert (snapshot / "disk.fake").is_file() and not (snapshot / "disk.qcow2").exists()
    assert not (snapshot / "agent.sock").exists()  # the backend's run-dir leftovers are gone

    forked = fake_daemon.fork("base", 3)
    assert forked["errors"] == [] and len({s["id"] for s in forked["sandboxes"]}) == 3
    child = forked["sandboxes"][0]["id"]
    ram = (fake_home / "sandboxes" / child / "ram").stat()
    assert ram.st_size == 1 << 30 and ram.st_blocks * 512 < 1 << 20  # a child of a 1 GiB snapshot costs no GiB
    assert fake_daemon.exec(child, "true")["exit_code"] == 0

    branched = fake_daemon.branch(child, "layer", mode="diff")
    assert branched["parent_tag"] == "base"
    assert (fake_home / "snapshots" / "layer" / "disk.fake").read_bytes().startswith(b"fake disk over ../base/disk.fake\n")
    flat = fake_daemon.compact("layer", "flat")  # the fake's disk format flattens; no branching needed
    assert flat["parent_tag"] is None
    assert (fake_home / "snapshots" / "flat" / "disk.fake").read_bytes().startswith(b"fake disk over base.ext4\n")
    again = fake_daemon.fork("flat", 1)
    assert again["errors"] == []
    assert {s["id"] for s in fake_daemon.sandboxes()} >= {child, again["sandboxes"][0]["id"]}
