"""The daemon's network face, on a real daemon process (no VM is started): token, TLS, limits, audit, metrics."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from free_ports import free_port

from forkd.listeners import TokenRejected, check_token
from forkd.sdk.controller import Controller
from forkd.sdk.errors import AuthenticationException

TOKEN = "f0e1d2c3b4a5968778695a4b3c2d1e0f00112233445566778899aabbccddeeff"


@pytest.mark.parametrize("bad", ["", "   ", "short-token", "changeme" * 5, "a" * 40, "0123456789" * 4,
                                 "abcdefghijklmnopqrstuvwxyz0123456789 withspace"])
def test_weak_tokens_are_rejected(bad: str) -> None:
    with pytest.raises(TokenRejected):
        check_token(bad)


def test_a_random_token_is_accepted() -> None:
    assert check_token(f"  {TOKEN}\n") == TOKEN


def _trusting(cert: str | Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def _daemon_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKD_")}
    env.update(FORKD_HOME=str(home), FORKD_SOCKET=str(home / "forkd.sock"), FORKD_CACHE=str(home / "cache"))
    return env


def _run_daemon(home: Path, *args: str, token: str | None = None) -> subprocess.Popen[bytes]:
    env = _daemon_env(home)
    if token is not None:
        env["FORKD_TOKEN"] = token
    log = open(home / "daemon.out", "ab")
    return subprocess.Popen([sys.executable, "-m", "forkd", "daemon", *args], env=env, stdout=log, stderr=log)


@pytest.mark.parametrize("address", ["127.0.0.1", "0.0.0.0"])
def test_tcp_without_a_token_refuses_to_start(tmp_path: Path, address: str) -> None:
    ran = subprocess.run([sys.executable, "-m", "forkd", "daemon", "--listen", f"{address}:{free_port()}"],
                         env=_daemon_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert ran.returncode != 0
    assert "needs a bearer token" in ran.stderr
    assert not (tmp_path / "forkd.sock").exists()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=120)
    return cert, key


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory, tls_files: tuple[Path, Path]) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("home")
    token_file = home / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    cert, key = tls_files
    process = _run_daemon(home, "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
                          "--tls-cert", str(cert), "--tls-key", str(key))
    url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/healthz", verify=_trusting(cert), timeout=2)
            break
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"daemon did not start: {(home / 'daemon.out').read_text()[-2000:]}")
            time.sleep(0.2)
    yield url, home
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)


def test_only_healthz_is_open_and_tokens_are_checked(tls_daemon: tuple[str, Path], tls_files: tuple[Path, Path]) -> None:
    url, _ = tls_daemon
    cert = str(tls_files[0])
    assert httpx.get(f"{url}/healthz", verify=_trusting(cert)).json() == {"ok": True}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"},
                    {"Authorization": TOKEN}):
        for path in ("/v1/version", "/metrics", "/v1/sandboxes", "/openapi.json"):
            answer = httpx.get(f"{url}{path}", headers=headers, verify=_trusting(cert))
            assert answer.status_code == 401, (path, headers)
            assert "FORKD_TOKEN" in answer.json()["error"]["message"]
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{url}/v1/version", headers=good, verify=_trusting(cert)).json()["forkd"]
    with pytest.raises(httpx.ConnectError):  # TLS: a client that does not trust the certificate stops
        httpx.get(f"{url}/healthz")


def test_controller_reads_url_token_and_ca_from_the_environment(tls_daemon: tuple[str, Path],
                                                                tls_files: tuple[Path, Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = tls_daemon
    monkeypatch.setenv("FORKD_URL", url)
    monkeypatch.setenv("FORKD_CA_CERT", str(tls_files[0]))
    monkeypatch.setenv("FORKD_TOKEN", TOKEN)
    with Controller() as controller:
        assert controller.sandboxes() == []
    monkeypatch.setenv("FORKD_TOKEN", "not-the-token")
    with Controller() as controller, pytest.raises(AuthenticationException):
        controller.sandboxes()


def test_body_limit_metrics_and_audit_log(tls_daemon: tuple[str, Path], tls_files: tuple[Path, Path]) -> None:
    url, home = tls_daemon
    cert = str(tls_files[0])
    good = {"Authorization": f"Bearer {TOKEN}"}
    huge = b'{"snapshot_tag": "' + b"x" * (40 << 20) + b'"}'
    answer = httpx.post(f"{url}/v1/sandboxes", content=huge, headers={**good, "content-type": "application/json"},
                        verify=_trusting(cert), timeout=60)
    assert answer.status_code == 413
    assert httpx.get(f"{url}/v1/sandboxes/sb-000000000000", headers=good, verify=_trusting(cert)).status_code == 404

    metrics = httpx.get(f"{url}/metrics", headers=good, verify=_trusting(cert)).text
    assert 'forkd_http_errors_total{route="/v1/sandboxes/{sandbox_id}",status="404"}' in metrics
    for family in ("forkd_spawn_seconds", "forkd_branch_seconds", "forkd_agent_roundtrip_seconds", "forkd_sandboxes"):
        assert f"# TYPE {family}" in metrics

    audit = home / "logs" / "audit.jsonl"
    entries = [json.loads(line) for line in audit.read_text().splitlines()]
    statuses = {(e["method"], e["path"], e["status"]) for e in entries}
    assert ("GET", "/v1/version", 401) in statuses and ("POST", "/v1/sandboxes", 413) in statuses
    lookup = next(e for e in entries if e["path"] == "/v1/sandboxes/sb-000000000000")
    assert lookup["sandbox_id"] == "sb-000000000000" and lookup["client"].startswith("127.0.0.1:")
    assert lookup["latency_ms"] >= 0 and lookup["time"] > 0


def test_audit_log_reopens_after_rotation(tls_daemon: tuple[str, Path], tls_files: tuple[Path, Path]) -> None:
    url, home = tls_daemon
    audit = home / "logs" / "audit.jsonl"
    audit.rename(audit.with_suffix(".jsonl.1"))
    pid = int(next(p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _is_daemon_of(p, home)))
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while not audit.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    httpx.get(f"{url}/healthz", verify=_trusting(tls_files[0]))
    assert any(json.loads(line)["path"] == "/healthz" for line in audit.read_text().splitlines())


def _is_daemon_of(proc: Path, home: Path) -> bool:
    try:
        return b"daemon" in (proc / "cmdline").read_bytes() and \
            f"FORKD_HOME={home}".encode() in (proc / "environ").read_bytes()
    except OSError:
        return False
