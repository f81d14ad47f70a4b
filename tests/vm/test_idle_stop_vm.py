"""Idle-stopped children (runtime/idle.py) on real QEMU guests through a real daemon: a child no request
reached for ``idle_stop_s`` is stopped, and answers its next request of any kind with its clock right;
a child running a server of its own is never stopped; with swap, a stopped child's memory is paged out
(runtime/reclaim.py) and comes back on its next request."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import zram_swap
from conftest import own_vm_daemon
from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.vm

IDLE_S = 1.0  # the daemon's idle_stop_s here (idle_reclaim is on by default): its keeper looks every 0.2 s
STOP_WAIT_S = 60.0  # bound on waiting for a child to be stopped (a loaded host answers slowly)
SNAPSHOT = "idle"


@pytest.fixture(scope="module")
def idle_daemon() -> Iterator[Controller]:
    with own_vm_daemon("forkd-idle-", IDLE_S) as controller:
        controller.create_snapshot(SNAPSHOT, memory_mib=512, warm_modules=[])
        yield controller


@pytest.fixture
def child(idle_daemon: Controller) -> Iterator[str]:
    result = idle_daemon.fork(SNAPSHOT, 1)
    assert result["errors"] == []
    sandbox_id = result["sandboxes"][0]["id"]
    yield sandbox_id
    with contextlib.suppress(ForkdError):
        idle_daemon.kill(sandbox_id)


def _vm_state(daemon: Controller, sandbox_id: str) -> str:
    [item] = [s for s in daemon.sandboxes() if s["id"] == sandbox_id]
    return item.get("vm_state", "missing")


def _woken_since(daemon: Controller, sandbox_id: str, since: float) -> bool:
    """The child ran after ``since`` (wall clock): it is running, or being stopped or stopped again after it
    (with a 1 s idle time a loaded host may stop it again before the listing; a child stopped before
    ``since`` and not woken stays ``idle_stopped`` with its old ``stopped_at``)."""
    [item] = [s for s in daemon.sandboxes() if s["id"] == sandbox_id]
    return item.get("vm_state") in ("running", "stopping") or (item.get("stopped_at") or 0) > since


def wait_stopped(daemon: Controller, sandbox_id: str) -> None:
    """Wait (bounded) until the child is idle-stopped; listing it is no request to its guest."""
    deadline = time.monotonic() + STOP_WAIT_S
    while _vm_state(daemon, sandbox_id) != "idle_stopped":
        assert time.monotonic() < deadline, f"{sandbox_id} was not stopped within {STOP_WAIT_S} s of idling"
        time.sleep(0.2)


def _metric(socket: str, name: str) -> float:
    with httpx.Client(transport=httpx.HTTPTransport(uds=socket), timeout=30) as client:
        text = client.get("http://forkd/metrics").text
    [line] = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def test_a_stopped_child_answers_exec_run_code_files_branch_and_fork(idle_daemon: Controller, child: str) -> None:
    wait_stopped(idle_daemon, child)
    assert _metric(idle_daemon.url.removeprefix("unix://"), "forkd_sandboxes_idle_stopped") >= 1
    sent = time.time()
    assert idle_daemon.exec(child, "echo awake")["stdout"] == "awake\n"
    assert _woken_since(idle_daemon, child, sent)
    wait_stopped(idle_daemon, child)
    assert idle_daemon.run_code(child, "x = 6 * 7\nx")["value"] == "42"
    wait_stopped(idle_daemon, child)
    idle_daemon.write_file(child, "/root/kept.txt", b"written to a stopped child")
    wait_stopped(idle_daemon, child)
    assert idle_daemon.read_file(child, "/root/kept.txt") == b"written to a stopped child"
    wait_stopped(idle_daemon, child)
    sent = time.time()
    branch = idle_daemon.branch(child, "idle-branch", mode="diff")
    assert branch["status"] == "ready"
    assert _woken_since(idle_daemon, child, sent)
    try:
        forked = idle_daemon.fork("idle-branch", 1)
        assert forked["errors"] == []
        grandchild = forked["sandboxes"][0]["id"]
        assert idle_daemon.read_file(grandchild, "/root/kept.txt") == b"written to a stopped child"
        assert idle_daemon.run_code(grandchild, "x")["value"] == "42"
        idle_daemon.kill(grandchild)
    finally:
        with contextlib.suppress(ForkdError):
            idle_daemon.remove_snapshot("idle-branch", force=True)


def test_a_woken_childs_clock_is_right(idle_daemon: Controller, child: str) -> None:
    wait_stopped(idle_daemon, child)
    time.sleep(5)  # a stopped guest's clock stands still: 5 s behind unless set on waking
    _assert_clock_right(idle_daemon, child)


def _assert_clock_right(daemon: Controller, sandbox_id: str) -> None:
    """The guest's clock, read while the request ran, within half a second of the host's over that time (a
    clock left standing while stopped for 5 s fails it unless the request itself took over 4.5 s)."""
    before = time.time()
    guest = float(daemon.exec(sandbox_id, "date +%s.%N")["stdout"])
    after = time.time()
    assert before - 0.5 <= guest <= after + 0.5, (before, guest, after)


def _serves(daemon: Controller, sandbox_id: str) -> bool:
    fetch = daemon.exec(sandbox_id, "python3 -c \"import urllib.request as u; "
                                    "print(u.urlopen('http://127.0.0.1:8000/').status)\"")
    return fetch["stdout"] == "200\n"


def test_a_child_running_a_server_is_never_stopped(idle_daemon: Controller, child: str) -> None:
    other = idle_daemon.fork(SNAPSHOT, 1)["sandboxes"][0]["id"]
    try:
        idle_daemon.exec(child, "nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
        deadline = time.monotonic() + STOP_WAIT_S
        while not _serves(idle_daemon, child):  # its server is up (a loaded TCG guest starts it slowly)
            assert time.monotonic() < deadline, "the guest's server did not start"
            time.sleep(0.5)
        wait_stopped(idle_daemon, other)  # the idle one is stopped meanwhile ...
        time.sleep(IDLE_S * 3)
        assert _vm_state(idle_daemon, child) == "running"  # ... the serving one never
        assert _serves(idle_daemon, child)
    finally:
        idle_daemon.kill(other)


def _rollup(pid: int) -> dict[str, int]:
    """KiB per field of the VMM's /proc/PID/smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split()[:2]
        fields[name.rstrip(":")] = int(value)
    return fields


def _listed(daemon: Controller, sandbox_id: str) -> dict[str, Any]:
    [item] = [s for s in daemon.sandboxes() if s["id"] == sandbox_id]
    return item


@pytest.mark.root("mkswap", "swapon")
def test_with_swap_a_stopped_childs_memory_is_paged_out_and_it_answers_right_after(
        zram: str, idle_daemon: Controller, child: str) -> None:
    """The zram swap is host-wide while it exists: made for this test only. A host with the zram driver
    that fails to set it up fails; only a kernel without the driver skips (the CI machines have it)."""
    idle_daemon.write_file(child, "/root/kept.txt", b"kept across a page-out")
    assert idle_daemon.run_code(child, "y = 6 * 7\ny")["value"] == "42"
    pid = int(_listed(idle_daemon, child)["pid"])
    running = _rollup(pid)  # what it holds while it runs (a stop without swap keeps all of it)
    deadline = time.monotonic() + STOP_WAIT_S
    while "reclaimed_kib" not in (item := _listed(idle_daemon, child)):
        assert time.monotonic() < deadline, f"{child} was not stopped and paged out within {STOP_WAIT_S} s: {item}"
        time.sleep(0.2)
    assert item["vm_state"] == "idle_stopped"
    paged = _rollup(pid)
    # The translation buffer, QEMU's heap and the guest's written pages leave RAM: most of it.
    assert paged["Private_Dirty"] < running["Private_Dirty"] / 2, (running, paged)
    assert running["Private_Dirty"] - paged["Private_Dirty"] > 10 << 10, (running, paged)
    assert paged["Swap"] > 10 << 10, paged
    assert zram_swap.mm_stat(zram)["orig_data_size"] > 10 << 20
    time.sleep(5)  # stopped a while: its clock stands still unless set on waking

    _assert_clock_right(idle_daemon, child)
    assert idle_daemon.exec(child, "echo awake")["stdout"] == "awake\n"
    assert idle_daemon.run_code(child, "y + 1")["value"] == "43"  # the interpreter's state came back
    assert idle_daemon.read_file(child, "/root/kept.txt") == b"kept across a page-out"
    assert "reclaimed_kib" not in _listed(idle_daemon, child)
