"""Real workloads in real children: a forked PostgreSQL per test and TLS trusting an image's extra CA (the
recipes that use them run in tests/vm/test_examples.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.sdk.controller import Controller

# The first test builds the workloads image (debootstrap of the scientific stack and PostgreSQL: minutes).
pytestmark = [pytest.mark.vm, pytest.mark.timeout(2400)]


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
        client = ("import sys, time, urllib.request\n"
                  "deadline = time.monotonic() + 90\n"  # a loaded TCG guest starts the server slowly
                  "while time.monotonic() < deadline:\n"
                  "    try:\n"
                  "        print(urllib.request.urlopen('https://localhost:8443/', timeout=5).status); break\n"
                  "    except ConnectionRefusedError: time.sleep(0.1)\n"
                  "    except OSError as e:\n"
                  "        if 'refused' not in str(e): raise\n"
                  "        time.sleep(0.1)\n"
                  "else:\n"
                  "    sys.exit('the server never listened: ' + open('/tmp/serve.log').read())\n")
        verified = daemon.exec(sandbox, ["python3", "-c", client], timeout_s=120)
        assert verified["exit_code"] == 0, verified
        assert verified["stdout"].strip() == "200"
        bundle = daemon.exec(sandbox, ["grep", "-c", "BEGIN CERTIFICATE", "/etc/ssl/certs/ca-certificates.crt"])
        assert int(bundle["stdout"]) > 100  # the public CAs are still there next to the extra one
    finally:
        daemon.kill(sandbox)


def test_warm_code_runs_once_in_the_template(daemon: Controller, workloads_snapshot: str) -> None:
    """The snapshot's warm code ran in the warm interpreter before the save: a name it defined is in every
    context, and what it started (pytest's plugins, imported by the pytest recipe's warm code) is already
    in a warm command's modules but not in a fresh python3's. The snapshot records the code."""
    assert "WARM_CODE_RAN = True" in daemon.snapshot(workloads_snapshot)["warm_code"]
    sandbox = daemon.fork(workloads_snapshot, 1)["sandboxes"][0]["id"]
    try:
        cell = daemon.run_code(sandbox, "WARM_CODE_RAN")
        assert cell["error"] is None and cell["value"] == "True", cell
        probe = ["python3", "-c", "import sys; print('_pytest.pastebin' in sys.modules)"]
        assert daemon.exec(sandbox, probe, warm=True)["stdout"].strip() == "True"
        assert daemon.exec(sandbox, probe)["stdout"].strip() == "False"
    finally:
        daemon.kill(sandbox)
