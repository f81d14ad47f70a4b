"""Snapshots on QEMU's microvm machine (``--machine microvm``) through a real daemon: their children answer,
fork, BRANCH, reach the network and are idle-stopped and continued like q35's; the device state is a
fraction of q35's; a q35 snapshot of the same daemon still restores.

One microvm snapshot is baked per module (a parent boot is most of its time).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from conftest import own_vm_daemon
from test_idle_stop_vm import wait_stopped
from test_network import OPEN_PORT, OUTSIDE, outside, probe  # noqa: F401 (outside: a fixture)
from test_pool_vm import fill

from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.vm

SNAPSHOT = "mvm"
Q35_SNAPSHOT = "mvm-q35"
IDLE_S = 2.0  # the daemon's idle_stop_s: children idle this long are stopped
MAX_STATE_BYTES = 200_000  # microvm's device state: ~65 KB measured (q35's ~680 KB)


@pytest.fixture(scope="module")
def mvm() -> Iterator[Controller]:
    """A daemon with one warm microvm snapshot (numpy imported)."""
    with own_vm_daemon("forkd-mvm-", IDLE_S) as controller:
        controller.create_snapshot(SNAPSHOT, machine="microvm", memory_mib=512, warm_modules=["numpy"])
        yield controller


@pytest.fixture
def fork(mvm: Controller) -> Iterator:
    made: list[str] = []

    def one(tag: str = SNAPSHOT, **options: object) -> str:
        result = mvm.fork(tag, 1, **options)
        assert result["errors"] == [], result["errors"]
        made.append(result["sandboxes"][0]["id"])
        return made[-1]

    yield one
    for sandbox_id in made:
        with contextlib.suppress(ForkdError):
            mvm.kill(sandbox_id)


def test_the_snapshot_records_its_machine_and_a_small_device_state(mvm: Controller) -> None:
    record = mvm.snapshot(SNAPSHOT)
    assert record["boot"]["machine"] == "microvm"
    assert record["identity"]["machine"] == "microvm-forkd1"
    assert record["sizes"]["state"] < MAX_STATE_BYTES, record["sizes"]


def test_children_run_on_microvm_and_answer_exec_and_run_code(mvm: Controller, fork) -> None:
    child = fork()
    seen = mvm.exec(child, "ls /sys/bus/pci/devices | wc -l; for d in /sys/bus/virtio/devices/*; do readlink -f $d; "
                           "done | grep -c LNRO0005; grep -o 'tsc_early_khz=[0-9]*' /proc/cmdline")["stdout"].split()
    assert seen[0] == "0", "a microvm guest has no PCI devices"
    assert int(seen[1]) >= 3, "root disk, NIC and agent serial on virtio-mmio"
    assert seen[2].startswith("tsc_early_khz=")
    assert mvm.run_code(child, "import numpy\nint(numpy.arange(10).sum())")["value"] == "45"


def test_a_branch_of_a_child_forks_grandchildren(mvm: Controller, fork) -> None:
    child = fork()
    mvm.exec(child, "echo from-the-child > /root/mark")
    branch = mvm.branch(child, "mvm-branch")
    assert branch["boot"]["machine"] == "microvm"
    try:
        grandchild = fork("mvm-branch")
        assert mvm.exec(grandchild, "cat /root/mark")["stdout"] == "from-the-child\n"
        assert mvm.run_code(grandchild, "6 * 7")["value"] == "42"
        mvm.kill(grandchild)
    finally:
        with contextlib.suppress(ForkdError):
            mvm.remove_snapshot("mvm-branch", force=True)


def test_a_diff_snapshot_of_a_microvm_snapshot_forks(mvm: Controller, fork) -> None:
    record = mvm.snapshot_diff(SNAPSHOT, "mvm-diff", "echo diffed > /root/diff-mark")
    assert record["identity"]["machine"] == "microvm-forkd1"
    try:
        child = fork("mvm-diff")
        assert mvm.exec(child, "cat /root/diff-mark")["stdout"] == "diffed\n"
        mvm.kill(child)
    finally:
        with contextlib.suppress(ForkdError):
            mvm.remove_snapshot("mvm-diff", force=True)


def test_a_nat_child_reaches_the_outside(mvm: Controller, outside: str, fork) -> None:  # noqa: F811
    child = fork(net="nat")
    assert probe(mvm, child, OUTSIDE, OPEN_PORT).startswith("ok hello")


def test_an_idle_child_is_stopped_and_continues_with_its_clock_right(mvm: Controller, fork) -> None:
    child = fork()
    mvm.exec(child, "true")
    wait_stopped(mvm, child)
    guest = float(mvm.exec(child, "date +%s.%N")["stdout"])
    assert abs(guest - time.time()) < 5, "the guest clock is set on continue"
    assert mvm.run_code(child, "1 + 1")["value"] == "2"


def test_a_warm_pool_member_of_a_microvm_snapshot_serves_a_fork(mvm: Controller, fork) -> None:
    members = fill(mvm, SNAPSHOT, 1)["members"]
    try:
        result = mvm.fork(SNAPSHOT, 1)
        [child] = result["sandboxes"]
        assert child["id"] in members and "pool" in child["timings"], child
        assert mvm.run_code(child["id"], "float(numpy.ones(4).sum())")["value"] == "4.0"
        mvm.kill(child["id"])
    finally:
        mvm.set_pool_size(SNAPSHOT, 0)


def test_a_q35_snapshot_of_the_same_daemon_still_restores(mvm: Controller, fork) -> None:
    record = mvm.create_snapshot(Q35_SNAPSHOT, memory_mib=512, warm_modules=[])
    try:
        assert record["boot"]["machine"] == "q35"
        assert record["sizes"]["state"] > mvm.snapshot(SNAPSHOT)["sizes"]["state"]
        child = fork(Q35_SNAPSHOT)
        assert int(mvm.exec(child, "ls /sys/bus/pci/devices | wc -l")["stdout"]) > 0
        mvm.kill(child)
    finally:
        with contextlib.suppress(ForkdError):
            mvm.remove_snapshot(Q35_SNAPSHOT, force=True)
