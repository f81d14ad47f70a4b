"""What operators read from a running daemon (fake backend, a real daemon process): a log with no ERROR
line while everything is healthy, one JSON object a line under ``log_format = "json"``, and /metrics with
build info, process metrics, request latencies, gauges present at 0 and failure reasons as labels."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

from conftest import fake_daemon_on
from forkd.sdk.controller import Controller, ForkdError


def _metrics(home: Path) -> str:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(home / "forkd.sock"))) as client:
        return client.get("http://forkd/metrics").text


def _sample(metrics: str, name: str, **labels: str) -> float | None:
    """The value of one series (labels matched as a subset), or None when it is absent."""
    for line in metrics.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if match and all(f'{key}="{value}"' in (match.group(1) or "") for key, value in labels.items()):
            return float(match.group(2))
    return None


def test_a_healthy_daemon_logs_json_lines_and_no_error(fake_home: Path) -> None:
    with fake_daemon_on(fake_home, 'log_format = "json"\n') as daemon:
        daemon.create_snapshot("base", memory_mib=256, warm_modules=[])
        children = [s["id"] for s in daemon.fork("base", 2)["sandboxes"]]
        assert daemon.exec(children[0], ["sh", "-c", "echo hi"])["exit_code"] == 0
        daemon.branch(children[0], "layer", mode="diff")
        for refused in (lambda: daemon.sandbox("sb-000000000000"), lambda: daemon.snapshot("nope")):
            try:  # a client's mistake is the client's: answered 404, not logged as the daemon's error
                refused()
            except ForkdError as exc:
                assert exc.status == 404
        for child in children:
            daemon.kill(child)
    lines = (fake_home / "daemon.log").read_text().splitlines()
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert entries and all({"ts", "level", "logger", "message"} <= entry.keys() for entry in entries)
    assert any("ready: serving on" in entry["message"] for entry in entries)
    assert [entry for entry in entries if entry["level"] in ("ERROR", "CRITICAL")] == []


def test_qemu_monitor_connect_retries_are_not_logged_as_errors(tmp_path: Path) -> None:
    """qemu.qmp logs each refused connect at ERROR; forkd retries those while QEMU starts (the real library,
    a socket nobody listens on, the daemon's own logging set-up)."""
    script = f"""
import asyncio, logging
from qemu.qmp import QMPClient
from forkd.daemon.config import load_config
from forkd.daemon.server import configure_logging
configure_logging(load_config(env={{}}))
logging.getLogger("forkd.test").error("the handler works")
async def attempt():
    try:
        await QMPClient("vm").connect({str(tmp_path / "absent.sock")!r})
    except Exception as exc:
        print("refused:", type(exc).__name__)
asyncio.run(attempt())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "refused:" in done.stdout, done.stderr
    assert [line for line in done.stderr.splitlines() if " ERROR " in line] == [
        line for line in done.stderr.splitlines() if "the handler works" in line] != []


def test_metrics_have_build_info_process_latency_zero_gauges_and_failure_reasons(fake_home: Path) -> None:
    with fake_daemon_on(fake_home, "[limits]\nmax_sandboxes = 1\n") as daemon:
        fresh = _metrics(fake_home)
        assert _sample(fresh, "forkd_build_info", vmm="fake") == 1.0
        assert re.search(r'forkd_build_info\{[^}]*version="\d', fresh)
        assert _sample(fresh, "process_resident_memory_bytes") > 0  # type: ignore[operator]
        assert _sample(fresh, "process_open_fds") is not None
        assert _sample(fresh, "forkd_sandboxes", state="running") == 0.0  # present at 0, not absent
        assert _sample(fresh, "forkd_snapshots", state="ready") == 0.0
        assert _sample(fresh, "forkd_snapshots", state="failed") == 0.0

        daemon.create_snapshot("base", memory_mib=256, warm_modules=[])
        forked = daemon.fork("base", 2)  # max_sandboxes = 1: one child is refused
        assert len(forked["sandboxes"]) == 1 and len(forked["errors"]) == 1
        reason = forked["errors"][0]["code"]
        after = _metrics(fake_home)
        assert _sample(after, "forkd_spawn_failures_total", reason=reason) == 1.0
        # The operator reads why in the daemon's log, not only the caller in its answer.
        logged = (fake_home / "daemon.log").read_text()
        assert f"a child of base failed to start ({reason}): {forked['errors'][0]['message']}" in logged, logged[-2000:]
        assert _sample(after, "forkd_sandboxes", state="running") == 1.0
        assert _sample(after, "forkd_http_request_duration_seconds_count", route="/v1/sandboxes",
                       method="POST") == 1.0
        daemon.kill(forked["sandboxes"][0]["id"])


def test_a_daemon_with_a_log_file_logs_there_not_to_stderr(fake_home: Path) -> None:
    log_file = fake_home / "logs" / "d.log"
    with fake_daemon_on(fake_home, f'log_file = "{log_file}"\n') as daemon:
        assert isinstance(daemon, Controller)
    assert "ready: serving on" in log_file.read_text()
    assert "ready: serving on" not in (fake_home / "daemon.log").read_text()  # the test harness's stderr file
