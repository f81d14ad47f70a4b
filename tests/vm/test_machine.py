"""The guest machine on real QEMU: a CPU model the scientific Python stack runs on, 2-vCPU snapshots,
the pinned machine type in the identity, and the VMM's confinement (seccomp, capabilities; the rest of its jail: tests/vm/test_confinement.py).

The workloads image (scipy and scikit-learn among its packages, so numpy uses OpenBLAS; built once
per machine, cached by its inputs, shared with tests/vm/test_workloads.py) gets one snapshot here with
2 vCPUs, which serves every test in this module.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest

from forkd.sdk.controller import Controller, ForkdError

# The first test may build the workloads image (a debootstrap of the scientific stack: minutes).
pytestmark = [pytest.mark.vm, pytest.mark.timeout(2400)]
TAG = "sci-2cpu"
# OpenBLAS picks its kernels from CPUID: with the old qemu64 model it ran 3DNow! code and died (SIGILL).
WORKLOAD = """
import numpy as np, scipy.linalg
from sklearn.cluster import KMeans
from sklearn.linear_model import LogisticRegression
a = np.arange(16.0).reshape(4, 4) + np.eye(4)
print("matmul", (a @ a).sum())
print("solve", bool(np.allclose(a @ scipy.linalg.solve(a, np.ones(4)), np.ones(4))))
rng = np.random.default_rng(0)
X = np.vstack([rng.normal(size=(50, 2)), rng.normal(size=(50, 2)) + 6])
y = np.array([0] * 50 + [1] * 50)
print("kmeans", sorted(np.bincount(KMeans(n_clusters=2, n_init=3, random_state=0).fit(X).labels_).tolist()))
print("logreg", LogisticRegression().fit(X, y).score(X, y))
"""
EXPECTED = "matmul 4164.0\nsolve True\nkmeans [50, 50]\nlogreg 1.0\n"


def _progress(line: str) -> None:
    print(f"[forkd] {line}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def sci_snapshot(daemon: Controller, workloads_image: str) -> Iterator[str]:
    daemon.create_snapshot(TAG, on_progress=_progress, image=workloads_image, memory_mib=1024, vcpus=2,
                           warm_modules=["numpy", "scipy.linalg", "sklearn.cluster", "sklearn.linear_model"])
    yield TAG
    with contextlib.suppress(ForkdError):
        daemon.remove_snapshot(TAG)


@pytest.fixture
def two(daemon: Controller, sci_snapshot: str) -> Iterator[list[dict]]:
    forked = daemon.fork(sci_snapshot, 2)
    assert forked["errors"] == []
    yield forked["sandboxes"]
    for child in forked["sandboxes"]:
        with contextlib.suppress(ForkdError):
            daemon.kill(child["id"])


def test_the_scientific_stack_runs_warm_and_fresh(daemon: Controller, two: list[dict]) -> None:
    sandbox_id = two[0]["id"]
    warm = daemon.run_code(sandbox_id, WORKLOAD, timeout_s=600)
    assert warm.get("error") is None, warm
    assert warm["stdout"] == EXPECTED
    # A fresh interpreter imports numpy, scipy and scikit-learn again: minutes under TCG on a busy host.
    fresh = daemon.exec(sandbox_id, ["python3", "-c", WORKLOAD], timeout_s=900)
    assert (fresh["exit_code"], fresh["stdout"]) == (0, EXPECTED), fresh["stderr"]


def test_snapshot_identity_pins_machine_and_cpu(daemon: Controller, sci_snapshot: str) -> None:
    identity = daemon.snapshot(sci_snapshot)["identity"]
    assert identity["machine"].startswith("pc-q35-")  # the versioned machine, not the q35 alias
    assert identity["vcpus"] == 2
    assert identity["cpu_model"] == ("host" if identity["accelerator"] == "kvm" else "Westmere-v1,-cx16")


def test_two_vcpu_children_work_and_are_distinct(daemon: Controller, two: list[dict]) -> None:
    seen = []
    for child in two:
        result = daemon.exec(child["id"], ["python3", "-c", "import os; print(len(os.sched_getaffinity(0)), "
                                           "os.urandom(8).hex())"])
        assert result["exit_code"] == 0, result["stderr"]
        cpus, token = result["stdout"].split()
        assert cpus == "2"
        seen.append(token)
        # Both vCPUs run guest code: one process pinned to each.
        pinned = daemon.exec(child["id"], "taskset -c 0 true && taskset -c 1 true && echo both")
        assert pinned["stdout"] == "both\n", pinned["stderr"]
    assert len(set(seen)) == 2


def test_the_vmm_runs_under_seccomp_without_capabilities(two: list[dict]) -> None:
    status = dict(line.split(":", 1) for line in open(f"/proc/{two[0]['pid']}/status").read().splitlines())
    assert status["Seccomp"].strip() == "2"  # QEMU's -sandbox filter
    assert status["NoNewPrivs"].strip() == "1"
    assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == 0  # its own uid, no capability left
    assert int(status["CapBnd"], 16) == (1 << 1) | (1 << 6) | (1 << 7)  # what it started with: dac_override, setgid, setuid
