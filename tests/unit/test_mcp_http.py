"""``forkd-mcp --transport http`` as a real process in front of a real daemon (fake VMM backend):
the bearer token from a 0600 file, DNS-rebinding checks for any loopback address, TLS off the loopback,
and the 0600 Unix socket alternative."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from conftest import fake_daemon_on
from forkd.listeners import ListenerError, TokenRejected, read_token_file

INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                         "clientInfo": {"name": "test", "version": "0"}}}
MCP_HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


def _mcp(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "forkd.mcp", "--transport", "http", *args], env=env,
                            stderr=subprocess.PIPE, text=True)


def _refusal(*args: str, env: dict[str, str]) -> str:
    """forkd-mcp's refusal to start: it must exit with a usage error, not serve."""
    process = _mcp(*args, env=env)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 2, stderr
    return stderr


@contextmanager
def _serving(*args: str, env: dict[str, str]) -> Iterator[str]:
    """A forkd-mcp process serving; yields the URL it announces."""
    process = _mcp(*args, env=env)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()  # the announcement comes before serving starts: no wait needed
        found = re.search(r"serving (\S+)", line)
        assert found, line + (process.stderr.read() if process.poll() is not None else "")
        yield found.group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


def _post(url: str, headers: dict[str, str]) -> httpx.Response:
    """One initialize request (the listener is bound before it is announced: the kernel queues it)."""
    return httpx.post(url, json=INITIALIZE, headers={**MCP_HEADERS, **headers}, timeout=60)


@pytest.fixture
def mcp_env(fake_home: Path, tmp_path: Path) -> Iterator[dict[str, str]]:
    """forkd-mcp's environment: a real daemon on the fake backend, and a token file path of its own."""
    with fake_daemon_on(fake_home) as _:
        env = {**os.environ, "FORKD_URL": f"unix://{fake_home / 'forkd.sock'}",
               "FORKD_MCP_TOKEN_FILE": str(tmp_path / "cfg" / "mcp-token"), "PYTHONPATH": os.pathsep.join(sys.path)}
        env.pop("FORKD_TOKEN", None)
        yield env


def test_http_needs_the_token_and_then_tools_reach_the_daemon(mcp_env: dict[str, str]) -> None:
    token_file = Path(mcp_env["FORKD_MCP_TOKEN_FILE"])
    with _serving("--port", "0", env=mcp_env) as url:
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600  # made on first start
        token = token_file.read_text().strip()
        assert len(token) >= 32
        assert _post(url, {}).status_code == 401
        assert _post(url, {"authorization": "Bearer " + "f" * 64}).status_code == 401

        async def call() -> object:
            async with httpx2.AsyncClient(headers={"authorization": f"Bearer {token}"}) as http:
                async with Client(streamable_http_client(url, http_client=http)) as client:
                    result = await client.call_tool("list_sandboxes", {})
                    assert not result.is_error, result  # with no daemon behind it, this is an error
                    return result.structured_content

        assert anyio.run(call) == {"result": []}  # the daemon's answer: no sandbox runs


def test_rebinding_is_refused_on_any_loopback_address(mcp_env: dict[str, str]) -> None:
    with _serving("--host", "127.0.0.2", "--port", "0", env=mcp_env) as url:
        bearer = {"authorization": f"Bearer {Path(mcp_env['FORKD_MCP_TOKEN_FILE']).read_text().strip()}"}
        port = url.split(":")[2].split("/")[0]
        assert _post(url, bearer).status_code == 200
        assert _post(url, {**bearer, "host": f"evil.example:{port}"}).status_code == 421
        assert _post(url, {**bearer, "origin": f"http://evil.example:{port}"}).status_code == 403
        assert _post(url, {**bearer, "origin": f"http://127.0.0.2:{port}"}).status_code == 200


def test_a_token_file_others_may_read_is_refused(mcp_env: dict[str, str]) -> None:
    token_file = Path(mcp_env["FORKD_MCP_TOKEN_FILE"])
    token_file.parent.mkdir()
    token_file.write_text("9f1c2b7a4e8d3f6a0b5c9e2d7f4a1b8c\n")
    token_file.chmod(0o644)
    assert "chmod 600" in _refusal("--port", "0", env=mcp_env)


def test_a_non_loopback_host_needs_tls(mcp_env: dict[str, str]) -> None:
    stderr = _refusal("--host", "0.0.0.0", "--port", "0", env=mcp_env)
    assert "needs TLS" in stderr and "--tls-cert" in stderr
    assert "No such option" in _refusal("--host", "0.0.0.0", "--allow-remote", env=mcp_env)  # no way around it


def test_a_unix_socket_is_private_and_needs_no_token(mcp_env: dict[str, str], fake_home: Path) -> None:
    path = fake_home / "mcp.sock"
    with _serving("--socket", str(path), env=mcp_env):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as http:
            answer = http.post("http://localhost/mcp", json=INITIALIZE, headers=MCP_HEADERS, timeout=60)
        assert answer.status_code == 200, answer.text


def test_token_files_are_made_private_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "token"
    token = read_token_file(path, create=True)
    assert read_token_file(path) == token and stat.S_IMODE(path.stat().st_mode) == 0o600
    short = tmp_path / "short"
    short.write_text("a1b2c3d4e5f6g7h8")
    short.chmod(0o600)
    with pytest.raises(TokenRejected, match="at least 32"):
        read_token_file(short)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ListenerError, match="symlink"):
        read_token_file(link)
