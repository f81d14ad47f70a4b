"""A client that goes away stops its work in the guest, and a reader that stalls pauses the guest:
the runtime's sessions (and the E2B code interpreter on them) over the real guest agent run as a
process on the host; the E2B route is served by uvicorn on a real socket so a client really leaves."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import uvicorn
from starlette.requests import Request
from test_runtime_fake_vmm import run

from forkd.daemon.app import create_app
from forkd.e2b.interpreter import Interpreter
from forkd.e2b.process import ProcessService
from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError
from forkd.runtime.execution import HOLD_FACTOR
from forkd.runtime.metrics import Metrics
from forkd.runtime.options import OutputLimits
from forkd.runtime.results import CellSpec, CommandSpec, Notice, Output, Started
from forkd.runtime.sessions import Sessions
from forkd.runtime.snapshots import READY_LINE_BYTES, ReadyLine

POLL_S = 0.05
SANDBOX = "sb-0123456789ab"


class _OneSandbox:
    """The sandbox service as sessions see it: one sandbox, served by a real agent process."""

    def __init__(self, agent: AgentClient) -> None:
        self.live = SimpleNamespace(agent=agent, record=SimpleNamespace(id=SANDBOX, meta={}), watcher=None)

    def get(self, sandbox_id: str) -> Any:
        assert sandbox_id == SANDBOX
        return self.live

    async def ended(self, sandbox_id: str, within_s: float = 5.0) -> bool:
        return False


@contextlib.asynccontextmanager
async def _agent(limits: OutputLimits | None = None) -> AsyncIterator[Sessions]:
    """Sessions on a guest agent process that connects to our socket (its unix transport)."""
    with tempfile.TemporaryDirectory(prefix="fkl-") as directory:  # short: sun_path is 108 bytes
        path = os.path.join(directory, "agent.sock")
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = \
            asyncio.get_running_loop().create_future()
        server = await asyncio.start_unix_server(lambda r, w: connected.set_result((r, w)), path,
                                                 limit=protocol.MAX_FRAME_BYTES + 1)
        process = await asyncio.create_subprocess_exec(sys.executable, "-m", "forkd.guest.agent",
                                                       "--transport", f"unix:{path}")
        agent = AgentClient(*await connected)
        try:
            yield Sessions(_OneSandbox(agent), limits)
        finally:
            await agent.close()
            server.close()
            try:
                await asyncio.wait_for(process.wait(), 10)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()


async def _until(check: Any) -> Any:
    """Poll ``check`` until it is truthy (the test's own bound ends a hang)."""
    while not (value := await check()):
        await asyncio.sleep(POLL_S)
    return value


async def _serve(sessions: Sessions) -> tuple[str, uvicorn.Server, asyncio.Task[None]]:
    """The E2B code interpreter's routes on a real socket, for the one sandbox."""
    interpreter = Interpreter(sessions)
    live = sessions.sandboxes.get(SANDBOX)  # type: ignore[attr-defined]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await (await interpreter.handle(Request(scope, receive), live))(scope, receive, send)

    return await serve_app(app)


async def serve_app(app: Any) -> tuple[str, uvicorn.Server, asyncio.Task[None]]:
    """``app`` served by uvicorn on a loopback socket: its URL, the server (``should_exit``) and its task."""
    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    host, port = listener.getsockname()
    return f"http://{host}:{port}", server, serving


async def _lines(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if line:
            yield json.loads(line)


def test_an_e2b_cell_whose_client_leaves_is_interrupted_and_the_next_cell_runs(tmp_path: Path) -> None:
    """The issue's reproduction: run_code(sleep, timeout=3) returned, but the next cell of that
    context waited for the sleep to end. Here the sleep would last the test's whole bound."""
    marker = tmp_path / "interrupted"
    sleeper = (f"import time\ntry:\n    print('started', flush=True)\n    time.sleep(3600)\n"
               f"except KeyboardInterrupt:\n    open({str(marker)!r}, 'w').write('yes')\n    raise\n")

    async def scenario() -> None:
        async with _agent() as sessions:
            url, server, serving = await _serve(sessions)
            try:
                async with httpx.AsyncClient(base_url=url, timeout=None) as client:
                    async with client.stream("POST", "/execute", json={"code": sleeper}) as answer:
                        first = await anext(_lines(answer))
                        assert first["type"] == "stdout" and first["text"] == "started\n"
                    # The client left mid-cell (as the SDK does when its timeout passes).
                    after = await client.post("/execute", json={"code": "print('next')"})
                    lines = [json.loads(line) for line in after.text.splitlines()]
                    assert [line["text"] for line in lines if line["type"] == "stdout"] == ["next\n"]
                    assert lines[-1]["type"] == "end_of_execution"
                    assert marker.read_text() == "yes"  # KeyboardInterrupt in the cell: the context lived on
            finally:
                server.should_exit = True
                await serving

    run(scenario)


async def _gone(sessions: Sessions, sandbox_id: str, pid: int) -> bool:
    listed = (await sessions.processes(sandbox_id))["processes"]
    return not any(p["pid"] == pid and p.get("running") for p in listed)


def test_a_command_whose_client_leaves_gets_sigint_then_is_killed_if_it_ignores_it(tmp_path: Path) -> None:
    marker = tmp_path / "got-int"
    polite = f"trap 'echo yes > {marker}; exit 7' INT; echo ready; while :; do sleep 0.1; done"
    stubborn = "trap '' INT; echo ready; while :; do sleep 0.1; done"

    async def started(sessions: Sessions, sandbox_id: str, cmd: str) -> int:
        execution = await sessions.start_exec(sandbox_id, CommandSpec(cmd=cmd, timeout_s=None))
        pid = None
        async for event in execution:
            if isinstance(event, Started):
                pid = event.pid
            if isinstance(event, Output) and "ready" in event.text:
                break  # leaving the iteration is what a route does when its client disconnects
        assert pid is not None
        return pid

    async def scenario() -> None:
        async with _agent() as sessions:
            pid = await started(sessions, SANDBOX, polite)
            await _until(lambda: _gone(sessions, SANDBOX, pid))
            assert marker.read_text() == "yes\n"  # it had SIGINT first, not SIGKILL
            pid = await started(sessions, SANDBOX, stubborn)
            await _until(lambda: _gone(sessions, SANDBOX, pid))  # killed after the grace period

    run(scenario)


def test_a_streamed_cell_flooding_display_with_no_reader_keeps_its_buffer_bounded(tmp_path: Path) -> None:
    """display() results counted 0 bytes: a cell nobody read held all of its output and the guest was
    never paused. The buffer is measured as the encoded size of what waits for the reader."""
    # 8 MiB of results against a 128 KiB buffer (the cell's answer lists its results again, in one frame
    # of at most 16 MiB: more would fail the cell)
    buffer, item, count = 128 << 10, 64 << 10, 128

    async def scenario() -> None:
        async with _agent(OutputLimits(stream_buffer_bytes=buffer)) as sessions:
            code = f"for i in range({count}):\n    display('x' * {item})\n"
            execution = await sessions.start_cell(SANDBOX, CellSpec(code=code))

            async def paused_or_done() -> bool:
                return execution.paused or execution._result is not None and execution._result.done()
            await _until(paused_or_done)
            waiting = sum(len(json.dumps(e.data)) if isinstance(e, Notice) else len(getattr(e, "text", ""))
                          for e, _ in execution._queue)
            assert execution.paused and waiting <= HOLD_FACTOR * buffer + 2 * item
            results = [e async for e in execution if isinstance(e, Notice) and e.name == "result"]
            assert len(results) == count  # resumed as it was read: nothing lost
            assert (await execution.raw_result()).get("error") is None

    run(scenario)


def test_a_warmup_line_without_newline_is_held_only_up_to_its_bound() -> None:
    """run_warmup kept a line with no newline whole (and copied it whole at every chunk)."""
    lines = ReadyLine()
    chunk = b"y" * (64 << 10)
    for _ in range(256):  # 16 MiB, no newline
        assert not lines.feed(chunk)
        assert len(lines.held) <= READY_LINE_BYTES
    assert not lines.feed(b'tail {"ready": true}\n')  # the end of the overlong line: skipped whole
    assert not lines.feed(b'{"ready": false}\n{"rea')
    assert lines.feed(b'dy": true}\n')  # a ready line split across chunks is found


def test_rest_watches_a_directory_through_the_session_layer(tmp_path: Path) -> None:
    """The REST API gained directory watchers through the sessions the E2B front uses."""
    async def scenario() -> None:
        async with _agent() as sessions:
            app = create_app(SimpleNamespace(sessions=sessions, metrics=Metrics()))  # type: ignore[arg-type]
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://daemon") as client:
                base = f"/v1/sandboxes/{SANDBOX}/watches"
                made = await client.post(base, json={"path": str(tmp_path), "recursive": True})
                assert made.status_code == 201, made.text
                watch = made.json()["id"]
                (tmp_path / "new.txt").write_text("hello")
                events = (await client.get(f"{base}/{watch}/events", params={"wait_s": 10})).json()["events"]
                assert {"name": "new.txt", "path": str(tmp_path / "new.txt"), "type": "create"} in events
                assert (await client.get(f"{base}/{watch}/events", params={"wait_s": 3600})).status_code == 400
                assert (await client.delete(f"{base}/{watch}")).json() == {"removed": True}
                gone = await client.get(f"{base}/{watch}/events")
                assert gone.status_code == 404, gone.text

    run(scenario)


def test_an_e2b_command_ends_when_its_start_requests_timeout_passes() -> None:
    """As in envd, Connect-Timeout-Ms (the SDK's ``timeout``) is the command's lifetime; before, a
    command started through the E2B front ran on after every SDK timeout."""
    async def scenario() -> list[Any]:
        async with _agent() as sessions:
            service = ProcessService(sessions)
            call = SimpleNamespace(live=sessions.sandboxes.get(SANDBOX),  # type: ignore[attr-defined]
                                   request=SimpleNamespace(headers={"connect-timeout-ms": "1000"}))
            stream = await service.start(call, {"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 3600"]}})  # type: ignore[arg-type]
            return [message["event"] async for message in stream]

    events = run(scenario)
    assert "start" in events[0] and events[-1] == {"end": {"exitCode": -1, "exited": False, "status": "signal: int"}}


def test_rest_runs_a_terminal_and_hangs_it_up_when_its_client_leaves(tmp_path: Path) -> None:
    """REST gained PTY sessions through the session layer: output streamed, input and resize by pid, and a
    client that leaves hangs its terminal up (the program's SIGHUP trap runs)."""
    marker = tmp_path / "hung-up"
    script = f"trap 'echo yes > {marker}; exit 0' HUP; read line; echo got:$line; stty size; sleep 3600"

    async def scenario() -> None:
        async with _agent() as sessions:
            app = create_app(SimpleNamespace(sessions=sessions, metrics=Metrics()))  # type: ignore[arg-type]
            url, server, serving = await serve_app(app)
            base = f"/v1/sandboxes/{SANDBOX}/pty"
            try:
                async with httpx.AsyncClient(base_url=url, timeout=None) as client:
                    async with client.stream("POST", base, json={"argv": ["/bin/sh", "-c", script]}) as answer:
                        lines = _lines(answer)
                        pid = (await anext(lines))["pid"]
                        resized = await client.post(f"{base}/{pid}/resize", json={"rows": 12, "cols": 40})
                        assert resized.status_code == 200, resized.text
                        typed = await client.post(f"{base}/{pid}/input", json={"data": "hello\n"})
                        assert typed.json() == {"pid": pid, "written": 6}
                        seen = b""
                        while b"12 40" not in seen:
                            event = await anext(lines)
                            assert event["event"] == "pty", event
                            seen += base64.b64decode(event["data_b64"])
                        assert b"got:hello" in seen
                    # The client left with the program still running: it is hung up.
                    await _until(lambda: _gone_terminal(sessions, pid))
                    assert marker.read_text() == "yes\n"
            finally:
                server.should_exit = True
                await serving

    run(scenario)


async def _gone_terminal(sessions: Sessions, pid: int) -> bool:
    try:
        await sessions.pty_resize(SANDBOX, pid, 24, 80)
    except AgentError as exc:
        return exc.code == "not_found"
    return False
