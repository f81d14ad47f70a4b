"""Every script under examples/ runs against a real daemon and snapshot, as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, vm_env: dict[str, str], snapshot_tag: str, *args: str) -> str:
    env = {**vm_env, "FORKD_URL": f"unix://{vm_env['FORKD_SOCKET']}", "FORKD_TEMPLATE": snapshot_tag}
    ran = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, f"{name} failed:\n{ran.stdout}\n{ran.stderr}"
    return ran.stdout


def test_e2b_sample_runs_unchanged(daemon: Controller, snapshot_tag: str, vm_env: dict[str, str]) -> None:
    out = run_example("e2b_compat.py", vm_env, snapshot_tag)
    assert "hello from sb-" in out
    assert "sum of y: 6" in out
    assert "first row: {'x': '1', 'y': '2'}" in out
    assert "exit code: 3" in out


def test_code_interpreter_loop(daemon: Controller, snapshot_tag: str, vm_env: dict[str, str]) -> None:
    out = run_example("code_interpreter.py", vm_env, snapshot_tag)
    assert "stdout: drew 10000" in out
    assert "[2] -> (10.0, 2.0)" in out
    assert "[3] error AttributeError" in out  # the mistake is reported, the session goes on
    assert "[4] -> True" in out
    assert "report: mean=" in out and "[5] -> 10" in out


def test_pytest_fanout(daemon: Controller, snapshot_tag: str, vm_env: dict[str, str]) -> None:
    out = run_example("pytest_fanout.py", vm_env, snapshot_tag, "--shards", "3")
    assert "shard 0: exit 0: 1 passed" in out
    assert "shard 1: exit 1: 1 failed" in out
    assert "shard 2: exit 0: 2 passed" in out
    assert "failed shards: [1]" in out


def test_branch_fanout(daemon: Controller, snapshot_tag: str, vm_env: dict[str, str]) -> None:
    before = {s["tag"] for s in daemon.snapshots()}
    out = run_example("branch_fanout.py", vm_env, snapshot_tag)
    for label in ("linear", "cubic", "degree 7"):
        assert f"{label:>9}: mean squared error" in out
    assert "source still has its state: 400" in out
    assert "best: cubic" in out or "best: degree 7" in out
    assert {s["tag"] for s in daemon.snapshots()} == before
