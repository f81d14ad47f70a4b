"""An idle-stopped child's memory paged out to swap (runtime/reclaim.py) on a real QEMU guest through a
real daemon, with a zram swap this module makes and removes: the VMM's Private_Dirty falls by a clear
margin, and the child then answers exec, run_code and a file read correctly with its clock right.

The swap is host-wide while it exists: the module holds it for one child's test only. A host whose
kernel has no zram driver skips (nothing to test there); a host with the driver that fails to set it
up fails (the CI machines have it: /sys/class/zram-control)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import zram_swap
from conftest import start_daemon, stop_daemon, vm_env_for
from forkd.sdk.controller import Controller, ForkdError

pytestmark = [pytest.mark.vm, pytest.mark.root("mkswap", "swapon")]

IDLE_S = 1.0
WAIT_S = 90.0  # bound on waiting for the stop and the page-out (a loaded host answers slowly)
SNAPSHOT = "reclaim"


@pytest.fixture(scope="module")
def swap() -> Iterator[str]:
    reason = zram_swap.unavailable()
    if reason:
        pytest.skip(reason)
    with zram_swap.zram_swap(512 << 20) as device:
        yield device


@pytest.fixture(scope="module")
def daemon(swap: str) -> Iterator[Controller]:
    home = Path(tempfile.mkdtemp(prefix="forkd-reclaim-", dir="/var/tmp"))
    env = vm_env_for(home)
    env["FORKD_IDLE_STOP_S"] = str(IDLE_S)  # idle_reclaim is on by default
    process, controller = start_daemon(home, env)
    try:
        controller.build_image(name="default")
        controller.create_snapshot(SNAPSHOT, memory_mib=512, warm_modules=[])
        yield controller
    finally:
        stop_daemon(process, controller, home)
        shutil.rmtree(home, ignore_errors=True)


def _rollup(pid: int) -> dict[str, int]:
    """KiB per field of the VMM's /proc/PID/smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split()[:2]
        fields[name.rstrip(":")] = int(value)
    return fields


def _listed(daemon: Controller, sandbox_id: str) -> dict[str, object]:
    [item] = [s for s in daemon.sandboxes() if s["id"] == sandbox_id]
    return item


def test_a_stopped_childs_memory_goes_to_swap_and_it_answers_right_after(daemon: Controller, swap: str) -> None:
    forked = daemon.fork(SNAPSHOT, 1)
    assert forked["errors"] == []
    child = forked["sandboxes"][0]["id"]
    try:
        daemon.write_file(child, "/root/kept.txt", b"kept across a page-out")
        assert daemon.run_code(child, "y = 6 * 7\ny")["value"] == "42"
        pid = int(_listed(daemon, child)["pid"])  # type: ignore[call-overload]
        running = _rollup(pid)  # what it holds while it runs (the idle stop keeps all of it)
        deadline = time.monotonic() + WAIT_S
        while "reclaimed_kib" not in (item := _listed(daemon, child)):
            assert time.monotonic() < deadline, f"{child} was not stopped and paged out within {WAIT_S} s: {item}"
            time.sleep(0.2)
        assert item["vm_state"] == "idle_stopped"
        paged = _rollup(pid)
        # The translation buffer, QEMU's heap and the guest's written pages leave RAM: most of it.
        assert paged["Private_Dirty"] < running["Private_Dirty"] / 2, (running, paged)
        assert running["Private_Dirty"] - paged["Private_Dirty"] > 10 << 10, (running, paged)
        assert paged["Swap"] > 10 << 10, paged
        assert zram_swap.mm_stat(swap)["orig_data_size"] > 10 << 20
        time.sleep(3)  # stopped a while: its clock stands still unless set on waking

        guest = float(daemon.exec(child, "date +%s.%N")["stdout"])
        assert abs(guest - time.time()) < 2.0
        assert daemon.exec(child, "echo awake")["stdout"] == "awake\n"
        assert daemon.run_code(child, "y + 1")["value"] == "43"  # the interpreter's state came back
        assert daemon.read_file(child, "/root/kept.txt") == b"kept across a page-out"
        assert "reclaimed_kib" not in _listed(daemon, child)
    finally:
        with contextlib.suppress(ForkdError):
            daemon.kill(child)
