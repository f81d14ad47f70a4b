"""runtime/sessions.py with the real host AgentClient, over a socket pair to a scripted guest.

The scripted guest speaks the wire protocol (it is a seam for the host logic: budgets, back-pressure,
cancel); the real agent is exercised by tests/unit/test_agent.py and the VM tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from starlette.requests import Request

from forkd.e2b.envd import Envd
from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError
from forkd.runtime.options import OutputLimits
from forkd.runtime.sandboxes import SandboxEnded
from forkd.runtime.results import CellSpec, CommandSpec, Output, Started
from forkd.runtime.sessions import WRITE_CHUNK_BYTES, Sessions
from forkd.runtime.spool import SpoolBudget
from forkd.store.errors import DiskFull
from forkd.store.space import SpaceFloor

CHUNK = b"x" * 4096


@dataclass
class ScriptedGuest:
    """Answers exec with ``chunks`` stdout chunks (fewer when it honours output_limit), then a result."""

    chunks: int = 10
    flow: bool = False  # implements flow.pause / flow.resume / cancel
    seen: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    paused: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    sent_chunks: int = 0
    writes_held: asyncio.Event | None = None  # files.write is answered only once this is set
    write_error: str | None = None  # files.write fails with this error code

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        resume = asyncio.Event()
        resume.set()
        tasks = set()

        def send(frame: dict[str, Any]) -> None:
            writer.write(protocol.encode_frame(frame))

        async def run_exec(req_id: int, args: dict[str, Any]) -> None:
            send(protocol.event(req_id, protocol.EVENT_STARTED, {"pid": 4242}))
            for _ in range(self.chunks):
                await resume.wait()
                if self.cancelled.is_set():
                    return
                send(protocol.event(req_id, protocol.EVENT_STDOUT, {"data_b64": protocol.b64encode(CHUNK)}))
                self.sent_chunks += 1
                try:
                    await writer.drain()
                except ConnectionError:
                    return  # the host went away
            send(protocol.ok(req_id, {"exit_code": 0, "signal": None, "timed_out": False, "duration_s": 0.1}))

        while line := await reader.readline():
            frame = json.loads(line)
            req_id, op, args = frame["id"], frame["op"], frame["args"]
            self.seen.append((op, args))
            if op in (protocol.OP_FLOW_PAUSE, protocol.OP_FLOW_RESUME, protocol.OP_CANCEL) and not self.flow:
                send(protocol.error(req_id, protocol.ERR_UNKNOWN_OP, f"unknown op {op!r}"))
            elif op == protocol.OP_FLOW_PAUSE:
                resume.clear()
                self.paused.set()
                send(protocol.ok(req_id))
            elif op == protocol.OP_FLOW_RESUME:
                resume.set()
                send(protocol.ok(req_id))
            elif op in (protocol.OP_CANCEL, protocol.OP_PROC_KILL):
                self.cancelled.set()
                resume.set()
                send(protocol.ok(req_id))
            elif op == protocol.OP_EXEC:
                task = asyncio.create_task(run_exec(req_id, args))
                tasks.add(task)
            elif op == protocol.OP_FILES_WRITE and self.write_error is not None:
                send(protocol.error(req_id, self.write_error, "no such directory"))
            elif op == protocol.OP_FILES_WRITE and self.writes_held is not None:
                await self.writes_held.wait()
                send(protocol.ok(req_id, {"op": op}))
            elif op == protocol.OP_RUN_CODE:
                send(protocol.event(req_id, protocol.EVENT_STDOUT, {"text": "é" * 3000}))
                send(protocol.ok(req_id, {"value": "1", "value_json": 1, "error": None}))
            else:
                send(protocol.ok(req_id, {"op": op}))
            await writer.drain()


@dataclass
class _Record:
    meta: dict[str, Any]


@dataclass
class _Live:
    agent: AgentClient
    record: _Record


class _Sandboxes:
    def __init__(self, agent: AgentClient) -> None:
        self.live = _Live(agent, _Record({"envs": {"A": "1"}}))

    def get(self, sandbox_id: str) -> _Live:
        return self.live

    async def ended(self, sandbox_id: str, within_s: float = 5.0) -> bool:
        return self.ended_flag

    ended_flag = False


async def _connected(guest: ScriptedGuest, limits: OutputLimits) -> tuple[Sessions, AgentClient, asyncio.Task[None]]:
    host_sock, guest_sock = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=host_sock)
    agent = AgentClient(reader, writer)
    g_reader, g_writer = await asyncio.open_connection(sock=guest_sock, limit=2 * protocol.MAX_FRAME_BYTES)
    serving = asyncio.create_task(guest.serve(g_reader, g_writer))
    return Sessions(_Sandboxes(agent), limits), agent, serving


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_result_keeps_at_most_its_budget_and_says_truncated() -> None:
    async def main() -> None:
        guest = ScriptedGuest(chunks=50)
        sessions, agent, serving = await _connected(guest, OutputLimits(result_bytes=10_000))
        result = await sessions.exec("sb", CommandSpec(cmd="yes"))
        assert result.truncated and len(result.stdout) == 10_000 and result.exit_code == 0
        op, args = guest.seen[0]
        assert op == protocol.OP_EXEC and args["output_limit"] == 10_000 and args["env"] == {"A": "1"}
        guest.chunks = 2
        small = await sessions.exec("sb", CommandSpec(argv=["true"], env={"B": "2"}))
        assert not small.truncated and len(small.stdout) == 2 * len(CHUNK)
        assert guest.seen[-1][1]["env"] == {"A": "1", "B": "2"}
        await agent.close()
        serving.cancel()
    run(main())


def test_text_is_decoded_whole_across_chunks_and_cells_are_bounded_too() -> None:
    async def main() -> None:
        guest = ScriptedGuest()
        sessions, agent, serving = await _connected(guest, OutputLimits(result_bytes=5000))
        cell = await sessions.run_code("sb", CellSpec(code="print('é' * 3000)"))
        assert cell.truncated and cell.value_json == 1 and cell.stdout == "é" * 2500
        await agent.close()
        serving.cancel()
    run(main())


def test_a_stream_not_read_pauses_the_guest_then_resumes() -> None:
    async def main() -> None:
        guest = ScriptedGuest(chunks=200, flow=True)
        sessions, agent, serving = await _connected(guest, OutputLimits(stream_buffer_bytes=16 * 4096))
        execution = await sessions.start_exec("sb", CommandSpec(cmd="yes"))
        await asyncio.wait_for(guest.paused.wait(), 10)
        assert guest.sent_chunks < 200  # the guest stopped sending while nobody read
        events = [event async for event in execution]
        assert isinstance(events[0], Started) and events[0].pid == 4242
        assert sum(len(e.text) for e in events if isinstance(e, Output)) == 200 * 4096
        assert (await execution.raw_result())["exit_code"] == 0
        assert (protocol.OP_FLOW_RESUME, {"id": execution._req_id}) in guest.seen
        await agent.close()
        serving.cancel()
    run(main())


def test_without_flow_control_the_reader_is_held_and_cancel_kills_the_process() -> None:
    async def main() -> None:
        guest = ScriptedGuest(chunks=10_000, flow=False)
        sessions, agent, serving = await _connected(guest, OutputLimits(stream_buffer_bytes=8 * 4096))
        execution = await sessions.start_exec("sb", CommandSpec(cmd="yes"))
        await asyncio.sleep(0.5)  # let it flood; the host holds its reader once the buffer is full
        assert execution._queued_bytes <= 4 * 8 * 4096 + len(CHUNK)
        execution.cancel()
        await asyncio.wait_for(guest.cancelled.wait(), 10)
        assert (protocol.OP_PROC_KILL, {"pid": 4242, "signal": 9}) in guest.seen
        assert guest.sent_chunks < 10_000
        await agent.close()
        serving.cancel()
    run(main())


def test_a_cancelled_collect_ends_the_call_in_the_guest() -> None:
    async def main() -> None:
        guest = ScriptedGuest(chunks=10_000, flow=True)
        sessions, agent, serving = await _connected(guest, OutputLimits())
        task = asyncio.create_task(sessions.exec("sb", CommandSpec(cmd="yes")))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(guest.cancelled.wait(), 10)
        assert any(op == protocol.OP_CANCEL for op, _ in guest.seen)
        await agent.close()
        serving.cancel()
    run(main())


def test_command_spec_needs_exactly_one_form() -> None:
    for bad in ({}, {"cmd": "ls", "argv": ["ls"]}):
        with pytest.raises(ValueError):
            CommandSpec(**bad)


def test_a_call_cut_by_the_sandbox_ending_says_so() -> None:
    async def main() -> None:
        guest = ScriptedGuest(chunks=10_000, flow=True)
        sessions, agent, serving = await _connected(guest, OutputLimits())
        sessions.sandboxes.ended_flag = True  # type: ignore[attr-defined]
        task = asyncio.create_task(sessions.exec("sb", CommandSpec(cmd="yes")))
        await asyncio.sleep(0.2)
        serving.cancel()
        agent._writer.transport.abort()  # the VM went away mid-call
        with pytest.raises(SandboxEnded, match="ended while the call ran"):
            await task
        await agent.close()
    run(main())


def _upload(pulled: list[int], pieces: int, size: int) -> Any:
    async def body() -> Any:
        for index in range(pieces):
            pulled.append(index)
            yield bytes([index]) * size
    return body()


def test_an_upload_is_read_whole_while_the_guest_is_still_writing(tmp_path: Any) -> None:
    """A slow guest must not stop the daemon reading the client's body (its TCP window would stay shut,
    and E2B's Python SDK gives up after 30 s of that)."""
    async def main() -> None:
        guest = ScriptedGuest(writes_held=asyncio.Event())
        sessions, _, _ = await _connected(guest, OutputLimits())
        sessions.spool_dir = tmp_path
        pulled: list[int] = []
        size = WRITE_CHUNK_BYTES // 2 + 1  # pieces straddle chunk boundaries
        writing = asyncio.create_task(sessions.write_file("sb-1", "/big", _upload(pulled, 7, size)))
        while len(pulled) < 7 or not any(op == protocol.OP_FILES_WRITE for op, _ in guest.seen):
            await asyncio.sleep(0.01)  # bounded by run(): before the spool this waited for the guest forever
        assert not writing.done()
        guest.writes_held.set()  # type: ignore[union-attr]
        assert await writing == 7 * size
        writes = [args for op, args in guest.seen if op == protocol.OP_FILES_WRITE]
        assert [(w["offset"], w["truncate"]) for w in writes] == [
            (0, True), (WRITE_CHUNK_BYTES, False), (2 * WRITE_CHUNK_BYTES, False), (3 * WRITE_CHUNK_BYTES, False)]
        data = b"".join(protocol.b64decode(w["data_b64"]) for w in writes)
        assert data == b"".join(bytes([index]) * size for index in range(7))
        assert list(tmp_path.iterdir()) == []  # spooled chunks are anonymous files

    run(main())


def test_an_empty_upload_creates_the_file_and_a_broken_body_fails_the_write() -> None:
    async def main() -> None:
        guest = ScriptedGuest()
        sessions, _, _ = await _connected(guest, OutputLimits())
        assert await sessions.write_file("sb-1", "/empty", _upload([], 0, 1)) == 0
        (write,) = [args for op, args in guest.seen if op == protocol.OP_FILES_WRITE]
        assert (write["data_b64"], write["truncate"]) == ("", True)

        async def broken() -> Any:
            yield b"x" * (WRITE_CHUNK_BYTES + 1)
            raise ConnectionResetError("client went away")

        with pytest.raises(ConnectionResetError, match="client went away"):
            await sessions.write_file("sb-1", "/broken", broken())
        assert (sessions.spool_budget.held_bytes, sessions.spool_budget.open_files) == (0, 0)  # all given back

    run(main())


def test_a_failed_guest_write_ends_the_upload_and_stops_reading_the_body() -> None:
    async def main() -> None:
        guest = ScriptedGuest(write_error=protocol.ERR_NOT_FOUND)
        sessions, _, _ = await _connected(guest, OutputLimits())
        pulled: list[int] = []
        body = _upload(pulled, 10_000, WRITE_CHUNK_BYTES)  # 40 GiB if it were all read
        with pytest.raises(AgentError) as failed:
            await sessions.write_file("sb-1", "/no/such/dir/file", body)
        assert failed.value.code == protocol.ERR_NOT_FOUND
        assert len(pulled) < 10_000
        assert (sessions.spool_budget.held_bytes, sessions.spool_budget.open_files) == (0, 0)

    run(main())


def test_an_e2b_upload_over_tcp_survives_a_client_that_gives_up_on_a_shut_window(tmp_path: Any) -> None:
    """The E2B files route on a real socket, with a client whose kernel aborts after 2 s of a shut TCP
    window (E2B's Python SDK sets 30 s): it sends its whole multipart body while the guest writes nothing."""
    async def main() -> None:
        guest = ScriptedGuest(writes_held=asyncio.Event())
        sessions, _, _ = await _connected(guest, OutputLimits())
        sessions.spool_dir = tmp_path
        envd, live = Envd(sessions), SimpleNamespace(record=SimpleNamespace(id="sb-1"))  # what the route reads

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                await (await envd.handle(Request(scope, receive), live))(scope, receive, send)  # type: ignore[arg-type]

        listener = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        data = bytes(range(256)) * (16 << 12)  # 16 MiB: more than the socket buffers hold
        boundary = "forkdtest"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/big\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
        head = (f"POST /files?path=/big HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode()

        def client() -> socket.socket:
            sock = socket.create_connection(listener.getsockname(), timeout=25)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 2000)
            sock.sendall(head + body)  # before the spool: ETIMEDOUT, the window stayed shut for the guest
            return sock

        try:
            sock = await asyncio.to_thread(client)
            with sock:
                guest.writes_held.set()  # type: ignore[union-attr]
                answer = await asyncio.to_thread(sock.recv, 65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            writes = [args for op, args in guest.seen if op == protocol.OP_FILES_WRITE]
            assert b"".join(protocol.b64decode(w["data_b64"]) for w in writes) == data
        finally:
            guest.writes_held.set()  # type: ignore[union-attr]
            server.should_exit = True
            await serving

    run(main())


def _spool_files(directory: Any) -> list[int]:
    """Sizes on disk (bytes allocated) of this process's open spool files under ``directory``."""
    sizes = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"{directory}/"):
                sizes.append(os.fstat(int(fd)).st_blocks * 512)
    return sizes


def test_stalled_uploads_stay_within_the_daemon_wide_spool_budget_and_descriptor_bound(tmp_path: Any) -> None:
    """8 uploads to a guest that writes nothing: the spool holds at most its budget's bytes on disk in at
    most its budget's files (one per upload), and the bodies stop being read; all finish once it writes."""
    uploads, pieces, budget = 8, 6, SpoolBudget(max_bytes=8 * WRITE_CHUNK_BYTES, max_files=4)

    async def main() -> None:
        guest = ScriptedGuest(writes_held=asyncio.Event())
        sessions, _, _ = await _connected(guest, OutputLimits())
        sessions.spool_dir, sessions.spool_budget = tmp_path, budget
        pulled: list[list[int]] = [[] for _ in range(uploads)]
        writing = [asyncio.create_task(sessions.write_file("sb-1", f"/up{i}", _upload(pulled[i], pieces,
                                                                                      WRITE_CHUNK_BYTES)))
                   for i in range(uploads)]
        while budget.held_bytes < budget.max_bytes or budget.open_files < budget.max_files:
            await asyncio.sleep(0.01)  # bounded by run()
        await asyncio.sleep(0.3)  # anything over the bounds would happen now
        files = _spool_files(tmp_path)
        assert len(files) == budget.open_files == budget.max_files
        assert sum(files) <= budget.held_bytes == budget.max_bytes
        ahead = budget.upload_bytes(WRITE_CHUNK_BYTES) // WRITE_CHUNK_BYTES
        assert sum(map(len, pulled)) <= budget.max_files * (ahead + 2) + (uploads - budget.max_files)
        assert not any(task.done() for task in writing)
        guest.writes_held.set()  # type: ignore[union-attr]
        assert await asyncio.gather(*writing) == [pieces * WRITE_CHUNK_BYTES] * uploads
        for i in range(uploads):
            writes = [args for op, args in guest.seen if op == protocol.OP_FILES_WRITE and args["path"] == f"/up{i}"]
            assert b"".join(protocol.b64decode(w["data_b64"]) for w in writes) == b"".join(
                bytes([index]) * WRITE_CHUNK_BYTES for index in range(pieces))
        assert (budget.held_bytes, budget.open_files, _spool_files(tmp_path)) == (0, 0, [])

    run(main())


def test_an_upload_that_would_break_the_free_space_floor_is_disk_full(tmp_path: Any) -> None:
    async def main() -> None:
        sessions, _, _ = await _connected(ScriptedGuest(), OutputLimits())
        sessions.spool_dir, sessions.space = tmp_path, SpaceFloor(floor_bytes=1 << 60)
        with pytest.raises(DiskFull, match=r"uploading '/x' to sb-1 writes under .*`\[disk\] min_free_mib`"):
            await sessions.write_file("sb-1", "/x", _upload([], 1, 10))

    run(main())


def test_the_spool_budget_is_daemon_config() -> None:
    from forkd.daemon.config import load_config
    options = load_config(env={}, overrides={"uploads.spool_mib": 64, "uploads.spool_files": 3}).runtime_options
    assert (options.spool_bytes, options.spool_files) == (64 << 20, 3)
