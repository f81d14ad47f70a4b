"""Real workloads in real children: a forked PostgreSQL per test, TLS trusting an image's extra CA, and the
recipes in examples/ that use them, run as users run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller

# The first test builds the workloads image (debootstrap of the scientific stack and PostgreSQL: minutes).
pytestmark = [pytest.mark.vm, pytest.mark.timeout(2400)]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, vm_env: dict[str, str], template: str, *args: str) -> str:
    env = {**vm_env, "FORKD_URL": f"unix://{vm_env['FORKD_SOCKET']}", "FORKD_TEMPLATE": template}
    ran = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True,
                         timeout=900)
    assert ran.returncode == 0, f"{name} failed:\n{ran.stdout}\n{ran.stderr}"
    return ran.stdout


def test_postgres_fork_per_test(workloads_snapshot: str, vm_env: dict[str, str]) -> None:
    """Each test's child has the seeded server running; its writes are invisible to its siblings."""
    out = dict(line.split(": ", 1) for line in run_example("postgres_fixture.py", vm_env, workloads_snapshot)
               .splitlines())
    assert json.loads(out["test_transfer"]) == {"balances": [["ada", "100"], ["grace", "200"], ["linus", "125"]]}
    assert json.loads(out["test_new_account"]) == {"count": 4}
    assert json.loads(out["test_sees_seed_only"]) == {"owners": ["ada", "grace", "linus"]}


def test_postgres_write_invisible_to_sibling(daemon: Controller, workloads_snapshot: str) -> None:
    forked = daemon.fork(workloads_snapshot, 2)
    assert forked["errors"] == []
    first, second = (child["id"] for child in forked["sandboxes"])
    try:
        psql = ["runuser", "-u", "postgres", "--", "psql", "-qAtX", "-v", "ON_ERROR_STOP=1", "-c"]
        wrote = daemon.exec(first, [*psql, "INSERT INTO accounts VALUES (9, 'only-in-first', 1)"], cwd="/tmp")
        assert wrote["exit_code"] == 0, wrote
        count = "SELECT count(*) FROM accounts WHERE owner = 'only-in-first'"
        assert daemon.exec(first, [*psql, count], cwd="/tmp")["stdout"].strip() == "1"
        assert daemon.exec(second, [*psql, count], cwd="/tmp")["stdout"].strip() == "0"
    finally:
        daemon.kill(first)
        daemon.kill(second)


HTTPS_SERVER = """
import http.server, ssl
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain('/root/server.pem', '/root/server.key')
server = http.server.HTTPServer(('127.0.0.1', 8443), http.server.SimpleHTTPRequestHandler)
server.socket = context.wrap_socket(server.socket, server_side=True)
print('{"ready": true}', flush=True)
server.serve_forever()
"""


def test_image_ca_certificate_is_trusted(daemon: Controller, workloads_snapshot: str,
                                         workloads_ca: tuple[Path, Path, Path]) -> None:
    """The image was built with an extra CA: a server certificate it signed verifies with the system trust
    store (Python's default context and curl-style OpenSSL users alike read the bundle it was added to)."""
    _, cert, key = workloads_ca
    sandbox = daemon.fork(workloads_snapshot, 1)["sandboxes"][0]["id"]
    try:
        daemon.write_file(sandbox, "/root/server.pem", cert.read_bytes())
        daemon.write_file(sandbox, "/root/server.key", key.read_bytes())
        daemon.write_file(sandbox, "/root/serve.py", HTTPS_SERVER.encode())
        daemon.exec(sandbox, "cd /tmp && nohup python3 /root/serve.py >/tmp/serve.log 2>&1 &")
        client = ("import time, urllib.request\n"
                  "for _ in range(100):\n"
                  "    try:\n"
                  "        print(urllib.request.urlopen('https://localhost:8443/', timeout=5).status); break\n"
                  "    except ConnectionRefusedError: time.sleep(0.1)\n"
                  "    except OSError as e:\n"
                  "        if 'refused' not in str(e): raise\n"
                  "        time.sleep(0.1)\n")
        verified = daemon.exec(sandbox, ["python3", "-c", client], timeout_s=120)
        assert verified["exit_code"] == 0, verified
        assert verified["stdout"].strip() == "200"
        bundle = daemon.exec(sandbox, ["grep", "-c", "BEGIN CERTIFICATE", "/etc/ssl/certs/ca-certificates.crt"])
        assert int(bundle["stdout"]) > 100  # the public CAs are still there next to the extra one
    finally:
        daemon.kill(sandbox)


def test_chart_session_returns_a_png(workloads_snapshot: str, vm_env: dict[str, str], tmp_path: Path) -> None:
    chart = tmp_path / "chart.png"
    out = run_example("chart_session.py", vm_env, workloads_snapshot, "--out", str(chart))
    assert "[1] -> " in out and "error" not in out, out
    assert f"[2] chart: {chart}" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[3] table as html" in out


def test_pytest_fanout_warm_fresh_and_serial_agree(workloads_snapshot: str, vm_env: dict[str, str]) -> None:
    """The same project run serially, one fresh process per file and one warm fork per file: same outcomes."""
    lines = run_example("pytest_warm_fanout.py", vm_env, workloads_snapshot, "--json").splitlines()
    modes = {entry["mode"]: entry for entry in map(json.loads, lines)}
    assert set(modes) == {"serial", "fresh", "warm"}
    assert [(r["exit_code"], r["passed"], r["failed"]) for r in modes["serial"]["runs"]] == [(1, 29, 1)]
    for mode in ("fresh", "warm"):
        outcomes = {r["files"][0]: (r["exit_code"], r["failed"]) for r in modes[mode]["runs"]}
        assert outcomes == {"test_arrays.py": (0, 0), "test_failures.py": (1, 1), "test_frames.py": (0, 0),
                            "test_linalg.py": (0, 0), "test_models.py": (0, 0)}, mode
        assert sum(r["passed"] for r in modes[mode]["runs"]) == 29, mode
