"""A whole daemon process on the fake VMM backend (``vmm = "fake"``), driven through the SDK: what
clusters and clients are tested against on hosts without QEMU. The real entry point, config layering,
socket, SQLite, store and guest protocol; no VM."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import start_daemon, stop_daemon, vm_env_for
from forkd.config import Paths
from forkd.guest.protocol import AGENT_VERSION
from forkd.image.store import KERNEL_FILE, INITRD_FILE, ROOTFS_FILE, write_manifest
from forkd.sdk.controller import Controller


@pytest.fixture
def home() -> Iterator[Path]:
    """Short: agent sockets live under it and a Unix socket path has at most 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="fkd-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _fake_image(cache: Path) -> None:
    """An image the fake backend boots: its files are never executed, only linked and hashed."""
    directory = Paths(home=cache, cache=cache, socket=cache / "s").images / "default"
    directory.mkdir(parents=True)
    for name in (KERNEL_FILE, INITRD_FILE, ROOTFS_FILE):
        (directory / name).write_bytes(name.encode())
    write_manifest(directory, {"name": "default", "key": "fake", "kernel_version": "6.12", "kernel_sha256": "0" * 64,
                               "agent_version": AGENT_VERSION, "created_at": 0.0, "size_bytes": 3,
                               "disk_size_mib": 1, "spec": {}, "inputs": {}})


@pytest.fixture
def fake_daemon(home: Path) -> Iterator[Controller]:
    env = vm_env_for(home)
    for variable in ("FORKD_LISTEN", "FORKD_E2B_LISTEN", "FORKD_CONFIG"):
        env.pop(variable, None)
    env.update(FORKD_VMM="fake", FORKD_CACHE=str(home / "cache"))
    _fake_image(home / "cache")
    process, controller = start_daemon(home, env)
    yield controller
    stop_daemon(process, controller, home)  # fails if a fake VMM process outlived the daemon


def test_a_daemon_on_the_fake_backend_bakes_forks_branches_and_compacts(fake_daemon: Controller, home: Path) -> None:
    assert fake_daemon.version()["vmm"] == "fake"
    fake_daemon.create_snapshot("base", memory_mib=1024, warm_modules=[])
    snapshot = home / "snapshots" / "base"
    assert (snapshot / "disk.fake").is_file() and not (snapshot / "disk.qcow2").exists()
    assert not (snapshot / "agent.sock").exists()  # the backend's run-dir leftovers are gone

    forked = fake_daemon.fork("base", 3)
    assert forked["errors"] == [] and len({s["id"] for s in forked["sandboxes"]}) == 3
    child = forked["sandboxes"][0]["id"]
    ram = (home / "sandboxes" / child / "ram").stat()
    assert ram.st_size == 1 << 30 and ram.st_blocks * 512 < 1 << 20  # a child of a 1 GiB snapshot costs no GiB
    assert fake_daemon.exec(child, "true")["exit_code"] == 0

    branched = fake_daemon.branch(child, "layer", mode="diff")
    assert branched["parent_tag"] == "base"
    assert (home / "snapshots" / "layer" / "disk.fake").read_bytes().startswith(b"fake disk over ../base/disk.fake\n")
    flat = fake_daemon.compact("layer", "flat")  # the fake's disk format flattens; no branching needed
    assert flat["parent_tag"] is None
    assert (home / "snapshots" / "flat" / "disk.fake").read_bytes().startswith(b"fake disk over base.ext4\n")
    again = fake_daemon.fork("flat", 1)
    assert again["errors"] == []
    assert {s["id"] for s in fake_daemon.sandboxes()} >= {child, again["sandboxes"][0]["id"]}
