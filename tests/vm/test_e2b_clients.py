"""E2B's own SDKs drive forkd through its E2B front: the real ``e2b`` and ``e2b-code-interpreter``
packages (Python; JavaScript under tests/e2b/js), pointed at the daemon only through E2B's
environment variables, against real guests."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import e2b_front, vmm_processes_under

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm
HERE = Path(__file__).resolve().parent.parent / "e2b"
PYTHON_CHECKS = {"commands", "stdout_streams_before_the_end", "background_command_killed", "stdin", "non_zero_exit",
                 "files", "watch", "pty", "second_client", "set_timeout", "list", "wrong_api_key", "unknown_sandbox",
                 "client_timeouts", "run_code", "charts", "fork", "pause_resume", "kill"}
JS_CHECKS = PYTHON_CHECKS
API_CHECKS = {"unsupported", "snapshots", "lifecycle", "metrics", "collected"}
JS_API_CHECKS = {"unsupported", "snapshots", "lifecycle", "metrics", "not_found_is_not_unsupported"}


@pytest.fixture(scope="module")
def e2b_env(daemon: Controller, snapshot_tag: str, workloads_snapshot: str, vm_env: dict[str, str],
            forkd_home: Path) -> dict[str, str]:
    """E2B's variables, and nothing of forkd's, for a client process (charts need the workloads
    snapshot's matplotlib)."""
    url, key = e2b_front(forkd_home, vm_env)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "E2B_"))}
    env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key,
               E2B_TEST_TEMPLATE=snapshot_tag, E2B_TEST_CHART_TEMPLATE=workloads_snapshot)
    return env


def run_checks(argv: list[str], env: dict[str, str], expected: set[str]) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1500)
    passed = set(re.findall(r"^ok (\S+)$", done.stdout, re.MULTILINE))
    summary = "\n".join(re.findall(r"^(?:ok|FAIL) .*$", done.stdout, re.MULTILINE))
    assert done.returncode == 0 and passed == expected, \
        f"exit {done.returncode}; missing {sorted(expected - passed)}\n{summary}\n{done.stderr[-8000:]}"


def test_python_sdk(e2b_env: dict[str, str]) -> None:
    run_checks([sys.executable, str(HERE / "python" / "sdk_check.py")], e2b_env, PYTHON_CHECKS)


def test_python_sdk_snapshots_lifecycle_metrics(e2b_env: dict[str, str]) -> None:
    """The rest of E2B's API (tests/e2b/python/api_check.py): snapshots, pause at the timeout and
    resume on the next request for 10 cycles with every kind of state, metrics, 501s, collection."""
    run_checks([sys.executable, str(HERE / "python" / "api_check.py")], e2b_env, API_CHECKS)


def test_javascript_sdk_snapshots_lifecycle_metrics(e2b_env: dict[str, str]) -> None:
    run_checks(["node", str(HERE / "js" / "api_check.mjs")], e2b_env, JS_API_CHECKS)


def test_javascript_sdk(e2b_env: dict[str, str]) -> None:
    """Node with the SDKs scripts/setup installed into tests/e2b/js (missing ones fail here, not skip)."""
    run_checks(["node", str(HERE / "js" / "sdk_check.mjs")], e2b_env, JS_CHECKS)


def test_bad_input_gets_e2b_errors_and_the_sandbox_carries_on(e2b_env: dict[str, str]) -> None:
    """Raw requests, as a broken or hostile client would send them, against one real sandbox."""
    url, key = e2b_env["E2B_API_URL"], e2b_env["E2B_API_KEY"]
    with httpx.Client(base_url=url, timeout=120) as client:
        created = client.post("/sandboxes", headers={"X-API-KEY": key},
                              json={"templateID": e2b_env["E2B_TEST_TEMPLATE"], "timeout": 600})
        assert created.status_code == 201, created.text
        sandbox = created.json()
        envd = {"E2b-Sandbox-Id": sandbox["sandboxID"], "E2b-Sandbox-Port": "49983",
                "X-Access-Token": sandbox["envdAccessToken"]}
        stream = {**envd, "Content-Type": "application/connect+json"}
        try:
            def end_error(answer: httpx.Response) -> dict[str, object]:
                assert answer.status_code == 200 and answer.content[0] == 2, answer.content[:200]
                return json.loads(answer.content[5:])["error"]

            start = "/process.Process/Start"
            assert end_error(client.post(start, headers=stream, content=b"\x00\x00\x00\x00\x10{}"))["code"] == \
                "invalid_argument"  # the body ends inside the envelope
            assert end_error(client.post(start, headers=stream, content=struct.pack(">BI", 0, 1 << 30)))["code"] == \
                "resource_exhausted"  # a 1 GiB envelope is refused from its header
            unknown = client.post("/process.Process/Fly", headers={**envd, "Content-Type": "application/json"}, json={})
            assert unknown.status_code == 501 and unknown.json()["code"] == "unimplemented"
            route = client.get("/nowhere", headers=envd)
            assert route.status_code == 404 and route.json()["code"] == 404
            wrong = client.post("/process.Process/List", headers={**envd, "X-Access-Token": "0" * 64},
                                json={})
            assert wrong.status_code == 401 and wrong.json()["code"] == "unauthenticated"
            bad_key = client.get("/v2/sandboxes", headers={"X-API-KEY": "e2b_" + "1" * 40})
            assert bad_key.status_code == 401 and bad_key.json()["code"] == 401
            # The listener and the sandbox are unaffected.
            listed = client.post("/process.Process/List", headers={**envd, "Content-Type": "application/json"},
                                 json={})
            assert listed.status_code == 200 and "processes" in listed.json()
            message = json.dumps({"process": {"cmd": "/bin/echo", "args": ["still here"]}}).encode()
            body = struct.pack(">BI", 0, len(message)) + message
            ran = client.post(start, headers=stream, content=body)
            assert ran.status_code == 200 and base64.b64encode(b"still here\n").decode() in ran.text
        finally:
            client.delete(f"/sandboxes/{sandbox['sandboxID']}", headers={"X-API-KEY": key})


STALLED_UPLOAD = """
import os, sys
from e2b import Sandbox
sbx = Sandbox.create(template=os.environ["E2B_TEST_TEMPLATE"], timeout=900)
print(sbx.sandbox_id, flush=True)
sys.stdin.readline()  # the test has stopped the sandbox's VMM
data = os.urandom(20 << 20)
try:
    sbx.files.write("/tmp/big.bin", data, request_timeout=900)
    print("written", flush=True)
    assert sbx.files.read("/tmp/big.bin", format="bytes", request_timeout=900) == data
    print("ok", flush=True)
finally:
    sbx.kill()
"""


def _cmdline(pid: int) -> bytes:
    """A process's command line; empty once it exited (another sandbox's VMM may end meanwhile)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_python_sdk_upload_outlasts_a_starved_guest(e2b_env: dict[str, str], forkd_home: Path) -> None:
    """The Python SDK's transport gives up on a connection whose TCP window stays shut for 30 s; the
    guest being stopped for longer than that in the middle of an upload makes it slower, not failed."""
    client = subprocess.Popen([sys.executable, "-c", STALLED_UPLOAD], env=e2b_env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        sandbox_id = client.stdout.readline().strip()  # type: ignore[union-attr]
        assert sandbox_id.startswith("sb-"), client.communicate(timeout=60)
        (vmm,) = [pid for pid in vmm_processes_under(forkd_home) if sandbox_id.encode() in _cmdline(pid)]
        os.kill(vmm, signal.SIGSTOP)
        try:
            client.stdin.write("go\n")  # type: ignore[union-attr]
            client.stdin.flush()  # type: ignore[union-attr]
            time.sleep(45)  # the upload starts against a guest that reads nothing
        finally:
            os.kill(vmm, signal.SIGCONT)
        out, err = client.communicate(timeout=900)
        assert client.returncode == 0 and out.split() == ["written", "ok"], f"{out}\n{err[-4000:]}"
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
