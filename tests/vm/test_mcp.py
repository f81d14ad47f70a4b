"""forkd-mcp as an MCP client sees it: a real server process (stdio or streamable HTTP) in front of
the session's real daemon, driving real guests."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from free_ports import free_port
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, ImageContent

from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.vm

SERVER = [sys.executable, "-m", "forkd.mcp"]  # what the forkd-mcp console script runs
READ_TIMEOUT_S = 300.0
#: A cell showing a PNG rich result without matplotlib (the shared snapshot's image has none).
CHART_CELL = (Path(__file__).resolve().parent.parent / "e2b" / "chart_cell.py").read_text()


@pytest.fixture(scope="module")
def server_env(vm_env: dict[str, str]) -> dict[str, str]:
    env = {"FORKD_URL": f"unix://{vm_env['FORKD_SOCKET']}"}
    if "PYTHONPATH" in os.environ:  # so the server imports the same forkd as this test
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def _stdio(server_env: dict[str, str]) -> Client:
    params = StdioServerParameters(command=SERVER[0], args=SERVER[1:], env=server_env)
    return Client(params, read_timeout_seconds=READ_TIMEOUT_S)


def _text(result: CallToolResult) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


async def _ok(client: Client, tool: str, **arguments: Any) -> Any:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, f"{tool} failed: {_text(result)}"
    content = result.structured_content
    assert content is not None
    return content.get("result", content) if set(content) == {"result"} else content


async def _error(client: Client, tool: str, **arguments: Any) -> str:
    result = await client.call_tool(tool, arguments)
    assert result.is_error, f"{tool} should have failed: {result.structured_content}"
    text = _text(result)
    assert "Traceback" not in text
    return text


def test_stdio_session_drives_a_sandbox(daemon: Controller, snapshot_tag: str, server_env: dict[str, str]) -> None:
    async def session() -> None:
        async with _stdio(server_env) as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            assert {"spawn", "exec", "run_code", "read_file", "write_file", "wait_for_text", "kill"} <= names
            assert snapshot_tag in [s["tag"] for s in await _ok(client, "list_snapshots")]

            spawned = await _ok(client, "spawn", snapshot_tag=snapshot_tag, count=1)
            assert spawned["errors"] == []
            sandbox_id = spawned["sandboxes"][0]["id"]
            try:
                assert sandbox_id in [s["id"] for s in await _ok(client, "list_sandboxes")]
                ran = await _ok(client, "exec", sandbox_id=sandbox_id, command="echo $GREETING; pwd; echo e >&2; "
                                "exit 3", cwd="/tmp", env={"GREETING": "hi"})
                assert (ran["stdout"], ran["stderr"], ran["exit_code"]) == ("hi\n/tmp\n", "e\n", 3)

                first = await _ok(client, "run_code", sandbox_id=sandbox_id, code="x = 20\nprint('set')\nx + 1")
                assert (first["stdout"], first["value"], first["error"]) == ("set\n", "21", None)
                assert (await _ok(client, "run_code", sandbox_id=sandbox_id, code="x * 2"))["value_json"] == 40
                failed = await _ok(client, "run_code", sandbox_id=sandbox_id, code="1 / 0")
                assert failed["error"]["name"] == "ZeroDivisionError"
                assert (await _ok(client, "eval", sandbox_id=sandbox_id, expr="x"))["type"] == "int"
                chart = await client.call_tool("run_code", {"sandbox_id": sandbox_id, "code": CHART_CELL})
                assert not chart.is_error and chart.structured_content["results"][0]["formats"] == ["png", "text"]
                (image,) = [block for block in chart.content if isinstance(block, ImageContent)]
                assert image.mime_type == "image/png" and base64.b64decode(image.data).startswith(b"\x89PNG")
                html = await client.call_tool("run_code", {"sandbox_id": sandbox_id, "code": (
                    "class T:\n    def _repr_html_(self): return '<b>bold</b>'\nT()")})
                assert "<b>bold</b>" in [getattr(block, "text", None) for block in html.content]

                await _ok(client, "write_file", sandbox_id=sandbox_id, path="/root/new/notes.txt", content="héllo\n",
                          mode="600")
                text = await _ok(client, "read_file", sandbox_id=sandbox_id, path="/root/new/notes.txt")
                assert (text["content"], text["encoding"], text["size"]) == ("héllo\n", "text", 7)
                assert (await _ok(client, "exec", sandbox_id=sandbox_id,
                                  command="stat -c %a /root/new/notes.txt"))["stdout"] == "600\n"
                blob = bytes(range(256))
                await _ok(client, "write_file", sandbox_id=sandbox_id, path="/root/blob",
                          content=base64.b64encode(blob).decode(), encoding="base64")
                binary = await _ok(client, "read_file", sandbox_id=sandbox_id, path="/root/blob")
                assert binary["encoding"] == "base64" and base64.b64decode(binary["content"]) == blob
                assert "max_bytes" in await _error(client, "read_file", sandbox_id=sandbox_id, path="/root/blob",
                                                   max_bytes=10)
                assert "is a directory" in await _error(client, "read_file", sandbox_id=sandbox_id, path="/root")

                branched = await _ok(client, "branch", sandbox_id=sandbox_id, mode="diff")
                assert branched["status"] == "ready" and branched["parent_tag"] == snapshot_tag
                copy = (await _ok(client, "spawn", snapshot_tag=branched["tag"], count=1))["sandboxes"][0]["id"]
                try:  # the copy has the interpreter state and files of the moment of the BRANCH
                    assert (await _ok(client, "eval", sandbox_id=copy, expr="x"))["value_json"] == 20
                    assert (await _ok(client, "read_file", sandbox_id=copy, path="/root/new/notes.txt"))[
                        "content"] == "héllo\n"
                finally:
                    await _ok(client, "kill", sandbox_id=copy)
                    daemon.remove_snapshot(branched["tag"])

                await _ok(client, "exec", sandbox_id=sandbox_id,
                          command="sh -c 'sleep 5; echo done > /tmp/m' > /dev/null 2>&1 &")  # well past the first poll
                waited = await _ok(client, "wait_for_text", sandbox_id=sandbox_id, path="/tmp/m", text="done",
                                   timeout_s=60, interval_s=0.2)
                assert waited["found"] and waited["polls"] > 1, waited
                missing = await _ok(client, "wait_for_text", sandbox_id=sandbox_id, path="/tmp/never", text="x",
                                    timeout_s=1, interval_s=0.2)
                assert not missing["found"] and not missing["file_exists"]
            finally:
                killed = await client.call_tool("kill", {"sandbox_id": sandbox_id})
            assert not killed.is_error, _text(killed)
            assert sandbox_id not in [s["id"] for s in await _ok(client, "list_sandboxes")]
            assert "has ended: killed" in await _error(client, "exec", sandbox_id=sandbox_id, command="true")

    anyio.run(session)


def test_stdio_errors_are_the_daemons_readable_messages(daemon: Controller, snapshot_tag: str,
                                                        server_env: dict[str, str]) -> None:
    async def session() -> None:
        async with _stdio(server_env) as client:
            bad_id = await _error(client, "exec", sandbox_id="not-a-sandbox", command="true")
            assert "invalid sandbox id 'not-a-sandbox'" in bad_id
            gone = await _error(client, "read_file", sandbox_id="sb-000000000000", path="/etc/hostname")
            assert "no running sandbox 'sb-000000000000'" in gone
            assert "forkd snapshot create" in await _error(client, "spawn", snapshot_tag="no-such-tag")
            taken = await _error(client, "create_snapshot", tag=snapshot_tag)
            assert snapshot_tag in taken and "Next: pick another tag" in taken
            branch = await _error(client, "branch", sandbox_id="sb-000000000000")
            assert "no running sandbox 'sb-000000000000'" in branch, branch

    anyio.run(session)


def test_create_snapshot_reports_progress(daemon: Controller, snapshot_tag: str,
                                         server_env: dict[str, str]) -> None:
    progress: list[tuple[float, str | None]] = []

    async def on_progress(value: float, _total: float | None, message: str | None) -> None:
        progress.append((value, message))

    async def session() -> dict[str, Any]:
        async with _stdio(server_env) as client:
            result = await client.call_tool("create_snapshot", {"tag": "mcp-progress", "memory_mib": 512,
                                                                "warm_modules": []}, progress_callback=on_progress)
            assert not result.is_error, _text(result)
            return result.structured_content

    try:
        created = anyio.run(session)
    finally:
        with contextlib.suppress(ForkdError):
            daemon.remove_snapshot("mcp-progress")
    assert (created["tag"], created["status"]) == ("mcp-progress", "ready")
    assert len(progress) >= 2 and all(message for _, message in progress)
    assert [value for value, _ in progress] == sorted(value for value, _ in progress), "progress must grow"


@pytest.fixture
def http_server(server_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[str, str]]:
    """forkd-mcp over HTTP, and the bearer token it made on first start in its 0600 token file."""
    port = free_port()
    token_file = tmp_path / "mcp-token"
    process = subprocess.Popen([*SERVER, "--transport", "http", "--host", "127.0.0.1", "--port", str(port)],
                               env={**os.environ, **server_env, "FORKD_MCP_TOKEN_FILE": str(token_file)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"forkd-mcp --transport http did not listen: {process.communicate()[0].decode()[-2000:]}")
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp", token_file.read_text().strip()
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_streamable_http_lists_tools_and_runs_exec(daemon: Controller, snapshot_tag: str,
                                                   http_server: tuple[str, str]) -> None:
    url, token = http_server
    sandbox_id = daemon.fork(snapshot_tag, 1)["sandboxes"][0]["id"]

    async def session() -> None:
        async with httpx2.AsyncClient(headers={"authorization": f"Bearer {token}"}, timeout=READ_TIMEOUT_S) as http, \
                Client(streamable_http_client(url, http_client=http), read_timeout_seconds=READ_TIMEOUT_S) as client:
            assert "exec" in {tool.name for tool in (await client.list_tools()).tools}
            ran = await _ok(client, "exec", sandbox_id=sandbox_id, command="hostname")
            assert ran["stdout"] == f"{sandbox_id}\n" and ran["exit_code"] == 0

    try:
        anyio.run(session)
    finally:
        with contextlib.suppress(ForkdError):
            daemon.kill(sandbox_id)
    # A page on another site cannot drive the local endpoint (DNS rebinding): foreign Host or Origin is refused.
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {token}"}
    assert httpx.post(url, json=ping, headers={**headers, "Host": "evil.example"}).status_code == 421
    assert httpx.post(url, json=ping, headers={**headers, "Origin": "http://evil.example"}).status_code == 403
    assert httpx.post(url, json=ping, headers={"Accept": headers["Accept"]}).status_code == 401  # no token


def test_stdio_terminal_and_watcher_on_a_real_guest(daemon: Controller, snapshot_tag: str,
                                                    server_env: dict[str, str]) -> None:
    """The terminal and watcher tools against a guest: a shell kept open between calls (echo, resize,
    close hangs it up), a file written in a watched directory seen as an event; and the stdio session's
    end hangs up a terminal left open."""
    async def session() -> int:
        async with _stdio(server_env) as client:
            spawned = await _ok(client, "spawn", snapshot_tag=snapshot_tag, count=1)
            sandbox_id = spawned["sandboxes"][0]["id"]
            try:
                opened = await _ok(client, "terminal_open", sandbox_id=sandbox_id, command="exec sh -i",
                                   env={"PS1": "$ "}, wait_s=30)
                terminal = opened["terminal_id"]
                sent = await _ok(client, "terminal_send", terminal_id=terminal, text="echo hi-$((6*7))",
                                 until="hi-42", wait_s=60)
                assert "hi-42" in sent["output"], sent
                await _ok(client, "terminal_resize", terminal_id=terminal, rows=12, cols=40)
                size = await _ok(client, "terminal_send", terminal_id=terminal, text="stty size", until="12 40",
                                 wait_s=60)
                assert "12 40" in size["output"], size
                await _ok(client, "terminal_close", terminal_id=terminal)
                assert "no terminal" in await _error(client, "terminal_read", terminal_id=terminal)
                hangup = time.monotonic() + 60
                while (await _ok(client, "exec", sandbox_id=sandbox_id, command=f"kill -0 {opened['pid']}"))[
                        "exit_code"] == 0:  # hung up by the daemon once the stream closed
                    assert time.monotonic() < hangup, "the closed terminal's shell still runs"
                    await anyio.sleep(1)

                await _ok(client, "exec", sandbox_id=sandbox_id, command="mkdir -p /root/watched")
                watch = (await _ok(client, "watch_start", sandbox_id=sandbox_id, path="/root/watched"))["watch_id"]
                await _ok(client, "write_file", sandbox_id=sandbox_id, path="/root/watched/new.txt", content="x")
                events: list[dict[str, Any]] = []
                deadline = time.monotonic() + 60
                while not any(e["name"] == "new.txt" for e in events) and time.monotonic() < deadline:
                    events += (await _ok(client, "watch_events", watch_id=watch, wait_s=10))["events"]
                assert any(e["name"] == "new.txt" and e["path"] == "/root/watched/new.txt" for e in events), events
                await _ok(client, "watch_stop", watch_id=watch)

                left = await _ok(client, "terminal_open", sandbox_id=sandbox_id, command="exec sh -i", wait_s=30)
                return left["pid"], sandbox_id  # type: ignore[return-value]
            except BaseException:
                await client.call_tool("kill", {"sandbox_id": sandbox_id})
                raise

    pid, sandbox_id = anyio.run(session)  # type: ignore[misc]
    try:  # forkd-mcp ended with its stdio session: the terminal it left open is hung up
        deadline = time.monotonic() + 60
        while daemon.exec(sandbox_id, f"kill -0 {pid}")["exit_code"] == 0:
            assert time.monotonic() < deadline, "the terminal outlived forkd-mcp"
            time.sleep(1)
    finally:
        daemon.kill(sandbox_id)
