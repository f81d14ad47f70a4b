"""MCP's terminal and watcher tools end to end without a VM: an in-process MCP client, forkd-mcp's tools,
the SDK over HTTP to the daemon's real REST app on a socket, the runtime's sessions and the real guest
agent run as a process on the host (its PTYs and inotify are the host's). The VM test
(tests/vm/test_mcp.py) drives the same tools against a real guest."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mcp import Client
from test_clients_leaving import SANDBOX, _agent, _gone_terminal, _until, serve_app
from test_runtime_fake_vmm import run

from forkd.daemon.app import create_app
from forkd.mcp.server import build_server
from forkd.mcp.terminals import BUFFER_BYTES, Holdings
from forkd.runtime.metrics import Metrics
from forkd.runtime.sessions import Sessions
from forkd.sdk.async_controller import AsyncController

SHELL = {"sandbox_id": SANDBOX, "command": "exec sh -i", "env": {"PS1": "$ "}}


@contextlib.asynccontextmanager
async def _mcp(idle_s: float = 900.0) -> AsyncIterator[tuple[Client, Holdings, Sessions]]:
    """An MCP client on forkd-mcp's tools, whose daemon is the REST app over one agent process."""
    async with _agent() as sessions:
        url, server, serving = await serve_app(create_app(SimpleNamespace(sessions=sessions, metrics=Metrics())))  # type: ignore[arg-type]
        try:
            async with AsyncController(url=url) as controller:
                holdings = Holdings(controller, idle_s=idle_s)
                try:
                    async with Client(build_server(controller, holdings)) as client:
                        yield client, holdings, sessions
                finally:
                    await holdings.close()
        finally:
            server.should_exit = True
            await serving


async def _tool(client: Client, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(name, arguments)
    assert not result.is_error, result.content
    return result.structured_content  # type: ignore[return-value]


async def _error(client: Client, name: str, arguments: dict[str, Any]) -> str:
    result = await client.call_tool(name, arguments)
    assert result.is_error
    return "".join(getattr(block, "text", "") for block in result.content)


def test_a_terminal_stays_open_between_calls_and_is_hung_up_when_closed() -> None:
    async def scenario() -> None:
        async with _mcp() as (client, _, sessions):
            opened = await _tool(client, "terminal_open", SHELL)
            terminal, pid = opened["terminal_id"], opened["pid"]
            assert opened["output"].endswith("$ ") and not opened["exited"]
            sent = await _tool(client, "terminal_send", {"terminal_id": terminal, "text": "echo hi-$((6*7))",
                                                         "until": "hi-42"})
            assert "hi-42" in sent["output"] and "\r" not in sent["output"]
            await _tool(client, "terminal_resize", {"terminal_id": terminal, "rows": 12, "cols": 40})
            size = await _tool(client, "terminal_send", {"terminal_id": terminal, "text": "stty size", "until": "12 40"})
            assert "12 40" in size["output"]
            # A variable set in one call is there in the next: the same shell all along.
            await _tool(client, "terminal_send", {"terminal_id": terminal, "text": "X=kept"})
            kept = await _tool(client, "terminal_send", {"terminal_id": terminal, "text": "echo $X-$$",
                                                         "until": "kept-"})
            assert f"kept-{pid}" in kept["output"]
            closed = await _tool(client, "terminal_close", {"terminal_id": terminal})
            assert closed["terminal_id"] == terminal
            await asyncio.wait_for(_until(lambda: _gone_terminal(sessions, pid)), 10)
            assert "no terminal" in await _error(client, "terminal_read", {"terminal_id": terminal})

    run(scenario)


def test_terminal_output_is_bounded_per_call_and_held_back_not_dropped() -> None:
    """A program writing 3 MB: forkd-mcp holds at most its buffer (the program is paused past it), each
    read answers at most max_bytes, and every byte arrives across the reads."""
    total = 3_000_000

    async def scenario() -> None:
        async with _mcp() as (client, holdings, _):
            opened = await _tool(client, "terminal_open", {
                "sandbox_id": SANDBOX, "command": f"head -c {total} /dev/zero | tr '\\0' x; echo; echo done",
                "wait_s": 0})
            terminal = holdings.terminals[opened["terminal_id"]]
            await asyncio.wait_for(_until(lambda: _full(terminal)), 30)
            await asyncio.sleep(0.5)  # the program is paused: the buffer stays at its bound
            assert len(terminal.buffer) <= BUFFER_BYTES + 65536
            seen, reads = opened["output"], 0
            while "done" not in seen:
                answer = await _tool(client, "terminal_read", {"terminal_id": opened["terminal_id"], "wait_s": 5,
                                                               "max_bytes": 1 << 20})
                assert len(answer["output"].encode()) <= 1 << 20
                seen += answer["output"]
                reads += 1
                assert reads < 40
            assert seen.count("x") == total
            final = await _tool(client, "terminal_read", {"terminal_id": opened["terminal_id"], "wait_s": 5})
            assert final["exited"] and final["exit_code"] == 0

    run(scenario)


async def _full(terminal: Any) -> bool:
    return len(terminal.buffer) >= BUFFER_BYTES


def test_idle_terminals_and_watchers_are_closed_and_so_is_everything_when_forkd_mcp_stops() -> None:
    async def scenario() -> None:
        async with _mcp(idle_s=60) as (client, holdings, sessions):
            first = await _tool(client, "terminal_open", SHELL)
            watch = await _tool(client, "watch_start", {"sandbox_id": SANDBOX, "path": "/tmp"})
            assert sorted(await holdings.sweep(time.monotonic() + 30)) == []  # not idle yet
            assert sorted(await holdings.sweep(time.monotonic() + 61)) == sorted([first["terminal_id"],
                                                                                  watch["watch_id"]])
            await asyncio.wait_for(_until(lambda: _gone_terminal(sessions, first["pid"])), 10)
            assert "no watcher" in await _error(client, "watch_events", {"watch_id": watch["watch_id"]})
            second = await _tool(client, "terminal_open", SHELL)
            await holdings.close()  # what forkd-mcp does when its session or server ends
            await asyncio.wait_for(_until(lambda: _gone_terminal(sessions, second["pid"])), 10)

    run(scenario)


def test_a_watcher_reports_a_file_written_in_its_directory(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with _mcp() as (client, _, _):
            watch = (await _tool(client, "watch_start", {"sandbox_id": SANDBOX, "path": str(tmp_path),
                                                         "recursive": True}))["watch_id"]
            assert (await _tool(client, "watch_events", {"watch_id": watch, "wait_s": 0}))["events"] == []
            (tmp_path / "seen.txt").write_text("hello")
            events: list[dict[str, Any]] = []
            while not any(e["name"] == "seen.txt" for e in events):
                answer = await _tool(client, "watch_events", {"watch_id": watch, "wait_s": 5, "max_events": 1})
                assert len(answer["events"]) <= 1
                events += answer["events"]
            assert {"create", "write"} & {e["type"] for e in events}
            assert (await _tool(client, "watch_stop", {"watch_id": watch}))["stopped"]
            assert "no watcher" in await _error(client, "watch_stop", {"watch_id": watch})
            missing = await _error(client, "watch_start", {"sandbox_id": SANDBOX, "path": str(tmp_path / "absent")})
            assert "no directory" in missing and "absent" in missing

    run(scenario)
