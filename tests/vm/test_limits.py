"""Per-sandbox cgroup limits on real children: applied to the VMM, read back, and the OOM killer reported."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import pytest

from forkd.host.cgroups import CgroupLayout, leftover_cgroups
from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.vm
MEMORY_LIMIT_MIB = 256


@pytest.fixture
def forked(daemon: Controller, snapshot_tag: str) -> Iterator:
    made: list[str] = []

    def fork(n: int = 1, **options: object) -> list[dict]:
        result = daemon.fork(snapshot_tag, n, **options)
        assert result["errors"] == [], result["errors"]
        made.extend(s["id"] for s in result["sandboxes"])
        return result["sandboxes"]

    yield fork
    for sandbox_id in made:
        with contextlib.suppress(ForkdError):
            daemon.kill(sandbox_id)


def _cgroup_file(controller: str, sandbox_id: str, name: str) -> str:
    layout = CgroupLayout.detect()
    assert layout is not None, "this host has no cgroups"
    return (layout.parents[controller] / sandbox_id / name).read_text().strip()


def test_memory_limit_kills_only_the_child_that_exceeds_it(daemon: Controller, forked) -> None:
    hog, bystander = forked(2, memory_limit_mib=MEMORY_LIMIT_MIB)
    assert hog["limits"] == {"memory_limit_mib": MEMORY_LIMIT_MIB}
    vmm_pid = hog["pid"]
    layout = CgroupLayout.detect()
    assert layout is not None and str(vmm_pid) in _cgroup_file("memory", hog["id"], "cgroup.procs").split()
    with pytest.raises(ForkdError):  # the VMM dies under the call: the agent goes away
        daemon.run_code(hog["id"], f"block = bytearray({2 * MEMORY_LIMIT_MIB} * 2**20)", timeout_s=300)
    deadline = time.monotonic() + 60
    while (ended := daemon.sandbox(hog["id"]))["status"] != "killed" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (ended["status"], ended["exit_reason"]) == ("killed", "out_of_memory")
    deadline = time.monotonic() + 30
    while hog["id"] in leftover_cgroups() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hog["id"] not in leftover_cgroups(), "the dead child's cgroup is removed"
    assert daemon.eval(bystander["id"], "6 * 7")["value_json"] == 42
    usage = daemon.sandbox(bystander["id"])["cgroup"]
    assert usage["memory_limit_mib"] == MEMORY_LIMIT_MIB and 0 < usage["memory_peak_kib"] <= MEMORY_LIMIT_MIB * 1024
    print(f"a child that answered one eval: cgroup memory now {usage['memory_current_kib']} KiB, "
          f"peak {usage['memory_peak_kib']} KiB", file=sys.stderr)


def test_pids_and_cpu_limits_are_applied_and_reported(daemon: Controller, forked) -> None:
    (child,) = forked(pids_max=64, cpu_quota=0.5, cpu_weight=50)
    assert child["limits"] == {"pids_max": 64, "cpu_quota": 0.5, "cpu_weight": 50}
    assert daemon.eval(child["id"], "1 + 1")["value_json"] == 2
    cgroup = daemon.sandbox(child["id"])["cgroup"]
    assert (cgroup["pids_max"], cgroup["cpu_quota"], cgroup["cpu_weight"]) == (64, 0.5, 50)
    assert 1 < cgroup["pids_current"] <= 64  # QEMU's threads are counted
    layout = CgroupLayout.detect()
    assert layout is not None
    if layout.version == 1:
        assert _cgroup_file("pids", child["id"], "pids.max") == "64"
        assert _cgroup_file("cpu", child["id"], "cpu.cfs_quota_us") == "50000"
        assert _cgroup_file("cpu", child["id"], "cpu.shares") == "512"
    else:
        assert _cgroup_file("cpu", child["id"], "cpu.max") == "50000 100000"
    listed = {s["id"]: s for s in daemon.sandboxes()}[child["id"]]
    assert listed["limits"] == child["limits"]


def test_limits_are_validated(daemon: Controller) -> None:
    for bad in ({"memory_limit_mib": 1}, {"cpu_quota": 0}, {"cpu_weight": 20000}, {"pids_max": 2}):
        with pytest.raises(ForkdError) as refused:
            daemon.fork("any-tag", 1, **bad)  # refused before any snapshot is looked up
        assert refused.value.status == 400
