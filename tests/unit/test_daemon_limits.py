"""What an unauthenticated network client can cost the daemon: the audit log is bounded and rotated,
and a connection that never finishes its request head is closed. A real daemon process (no VM)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from free_ports import free_port

TOKEN = "9d8c7b6a5f4e3d2c1b0a99887766554433221100ffeeddccbbaa998877665544"
AUDIT_MAX_BYTES = 16384
AUDIT_BACKUPS = 2
MAX_CONNECTIONS = 50


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("home")
    (home / "token").write_text(TOKEN)
    port = free_port()
    (home / "forkd.toml").write_text(
        f'listen = "127.0.0.1:{port}"\ntoken_file = "{home / "token"}"\n'
        f'[audit]\nmax_bytes = {AUDIT_MAX_BYTES}\nbackups = {AUDIT_BACKUPS}\n'
        f'[server]\nheader_timeout_s = 1\nmax_connections = {MAX_CONNECTIONS}\nkeep_alive_s = 300\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKD_")}
    env.update(FORKD_HOME=str(home), FORKD_SOCKET=str(home / "forkd.sock"), FORKD_CACHE=str(home / "cache"))
    with open(home / "daemon.out", "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "forkd", "daemon", "--config", str(home / "forkd.toml")],
                                   env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/healthz", timeout=2)
            break
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"daemon did not start: {(home / 'daemon.out').read_text()[-2000:]}")
            time.sleep(0.2)
    yield url, home
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)


def test_unauthenticated_floods_keep_the_audit_log_within_its_budget(daemon: tuple[str, Path]) -> None:
    url, home = daemon
    with httpx.Client() as client:
        for i in range(300):
            assert client.get(f"{url}/v1/{'x' * 8000}{i}").status_code == 401
    logs = sorted((home / "logs").glob("audit.jsonl*"))
    assert [p.name for p in logs] == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    assert all(p.stat().st_size <= AUDIT_MAX_BYTES for p in logs)
    assert all(len(line) < 1024 for p in logs for line in p.read_bytes().splitlines())
    assert "...(+" in (home / "logs" / "audit.jsonl").read_text()


def test_a_connection_that_never_sends_its_head_is_closed(daemon: tuple[str, Path]) -> None:
    url, _ = daemon
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert slow.recv(1024) == b""  # closed by the daemon (the 30 s socket timeout bounds the wait)
    assert httpx.get(f"{url}/healthz").json() == {"ok": True}


def test_connections_past_the_limit_are_answered_503_until_some_close(daemon: tuple[str, Path]) -> None:
    url, _ = daemon
    held = [httpx.Client(timeout=30) for _ in range(MAX_CONNECTIONS)]
    try:
        for client in held:  # each keeps its connection open (keep-alive)
            client.get(f"{url}/healthz")
        assert httpx.get(f"{url}/healthz", timeout=30).status_code == 503
    finally:
        for client in held:
            client.close()
    for _ in range(300):  # bounded: the daemon notices the closed connections at once, 30 s at most
        if httpx.get(f"{url}/healthz", timeout=30).status_code == 200:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the daemon still refused connections after the held ones closed")
