"""Every script under examples/ runs against a real daemon and snapshot, as a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, vm_env: dict[str, str], snapshot_tag: str, *args: str, timeout_s: float = 480) -> str:
    """Run ``examples/NAME`` against the test daemon with ``snapshot_tag`` as its template; its stdout.

    ``timeout_s`` stays under the test's own timeout, so an example that hangs fails with what it
    printed up to then (where it stopped), not with pytest-timeout's stack of this process."""
    env = {**vm_env, "FORKD_URL": f"unix://{vm_env['FORKD_SOCKET']}", "FORKD_TEMPLATE": snapshot_tag}
    try:
        ran = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True,
                             timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        printed = [part.decode(errors="replace") if isinstance(part, bytes) else part or "" for part in (exc.stdout, exc.stderr)]
        pytest.fail(f"{name} did not end within {timeout_s:.0f} s; it printed:\n" + "\n".join(printed)
                    + f"\nthe daemon then:\n{daemon_state(vm_env)}")
    assert ran.returncode == 0, f"{name} failed:\n{ran.stdout}\n{ran.stderr}"
    return ran.stdout


def daemon_state(vm_env: dict[str, str]) -> str:
    """What the daemon holds and the end of its log: where a hung example waits is usually visible there."""
    try:
        with Controller(url=f"unix://{vm_env['FORKD_SOCKET']}", timeout=10) as api:
            held = json.dumps({"sandboxes": [(s["id"], s["snapshot_tag"], s.get("vm_state")) for s in api.sandboxes()],
                               "snapshots": [(s["tag"], s["status"]) for s in api.snapshots()]})
    except Exception as exc:  # noqa: BLE001 - a daemon that does not answer is itself the answer
        held = f"(the daemon did not answer: {exc})"
    log = Path(vm_env["FORKD_HOME"]) / "daemon.log"
    return held + "\n" + (log.read_text(errors="replace")[-4000:] if log.exists() else "(no daemon.log)")


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


@pytest.mark.timeout(2400)  # may build the workloads image first (minutes)
def test_postgres_fork_per_test(workloads_snapshot: str, vm_env: dict[str, str]) -> None:
    """Each test's child has the seeded server running; its writes are invisible to its siblings."""
    out = dict(line.split(": ", 1) for line in run_example("postgres_fixture.py", vm_env, workloads_snapshot, timeout_s=900)
               .splitlines())
    assert json.loads(out["test_transfer"]) == {"balances": [["ada", "100"], ["grace", "200"], ["linus", "125"]]}
    assert json.loads(out["test_new_account"]) == {"count": 4}
    assert json.loads(out["test_sees_seed_only"]) == {"owners": ["ada", "grace", "linus"]}


@pytest.mark.timeout(2400)  # may build the workloads image first (minutes)
def test_chart_session_returns_a_png(workloads_snapshot: str, vm_env: dict[str, str], tmp_path: Path) -> None:
    chart = tmp_path / "chart.png"
    out = run_example("chart_session.py", vm_env, workloads_snapshot, "--out", str(chart), timeout_s=900)
    assert "[1] -> " in out and "error" not in out, out
    assert f"[2] chart: {chart}" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[3] table as html" in out


@pytest.mark.timeout(2400)  # may build the workloads image first (minutes)
def test_pytest_fanout_warm_fresh_and_serial_agree(workloads_snapshot: str, vm_env: dict[str, str]) -> None:
    """The same project run serially, one fresh process per file and one warm fork per file: same outcomes."""
    lines = run_example("pytest_warm_fanout.py", vm_env, workloads_snapshot, "--json", timeout_s=900).splitlines()
    modes = {entry["mode"]: entry for entry in map(json.loads, lines)}
    assert set(modes) == {"serial", "fresh", "warm"}
    assert [(r["exit_code"], r["passed"], r["failed"]) for r in modes["serial"]["runs"]] == [(1, 29, 1)]
    for mode in ("fresh", "warm"):
        outcomes = {r["files"][0]: (r["exit_code"], r["failed"]) for r in modes[mode]["runs"]}
        assert outcomes == {"test_arrays.py": (0, 0), "test_failures.py": (1, 1), "test_frames.py": (0, 0),
                            "test_linalg.py": (0, 0), "test_models.py": (0, 0)}, mode
        assert sum(r["passed"] for r in modes[mode]["runs"]) == 29, mode
