"""The host side of the guest protocol against a hostile guest: the real AgentClient over a real Unix socket.

The peer is a stand-in guest that reads requests and writes whatever bytes a test gives it; a frame
that breaks the protocol must fail every pending call at once (never leave one waiting for its
timeout) and, in a SandboxService, kill the sandbox and release everything it held.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from forkd.config import Paths
from forkd.guest import protocol
from forkd.runtime import timings as timings_module
from forkd.runtime.agent_client import AgentClient, AgentUnavailable
from forkd.runtime.timings import Timings
from forkd.runtime.sandboxes import SandboxService
from forkd.store.registry import Registry, SandboxRecord
from forkd.vmm.base import VmHandle

pytestmark = pytest.mark.timeout(60)
BOUND_S = 10.0  # far above how long failing takes; only bounds a hang


def _deep(levels: int) -> bytes:
    return b'{"id": 1, "event": "stdout", "data": ' + b"[" * levels + b"]" * levels + b"}\n"


def _event(req_id: object, data: object) -> bytes:
    return json.dumps({"id": req_id, "event": "stdout", "data": data}).encode() + b"\n"


HOSTILE = {
    "deep nesting": lambda req_id: _deep(200_000),
    "non-object data": lambda req_id: _event(req_id, [1, 2, 3]),
    "string data": lambda req_id: _event(req_id, "boom"),
    "list id": lambda req_id: _event([req_id], {}),
    "non-object result": lambda req_id: json.dumps({"id": req_id, "ok": True, "result": [1]}).encode() + b"\n",
    "non-boolean ok": lambda req_id: json.dumps({"id": req_id, "ok": "yes"}).encode() + b"\n",
    "event without a name": lambda req_id: json.dumps({"id": req_id, "data": {}}).encode() + b"\n",
    "bad base64 for its handler": lambda req_id: _event(req_id, {"data_b64": "%%%not base64"}),
    "oversize line": lambda req_id: b"x" * (protocol.MAX_FRAME_BYTES + 2) + b"\n",
    "a later line that is not JSON": lambda req_id: b"not a frame\n",
    "a later line that is not an object": lambda req_id: b"[1, 2]\n",
}


class Guest:
    """A stand-in guest on a real Unix socket: hands every request to the test and writes what it is told."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[dict] = asyncio.Queue()
        self.writer: asyncio.StreamWriter | None = None
        self.connected = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.connected.set()
        while line := await reader.readline():
            await self.requests.put(json.loads(line))

    async def send(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)
        await self.writer.drain()


async def _with_guest(tmp_path: Path, body: Callable[[AgentClient, Guest], Awaitable[None]]) -> None:
    guest = Guest()
    server = await asyncio.start_unix_server(guest.serve, path=str(tmp_path / "agent.sock"))
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "agent.sock"), limit=protocol.MAX_FRAME_BYTES + 1)
    client = AgentClient(reader, writer)
    try:
        await asyncio.wait_for(guest.connected.wait(), BOUND_S)
        await body(client, guest)
    finally:
        await client.close()
        server.close()


def _echo_handler(name: str, data: dict) -> None:
    if "data_b64" in data:
        protocol.b64decode(data["data_b64"])


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_frame_fails_every_pending_call_at_once(case: str, tmp_path: Path) -> None:
    violations: list[str] = []

    async def body(client: AgentClient, guest: Guest) -> None:
        client.on_violation = violations.append
        first = asyncio.create_task(client.call("exec", {}, timeout=300, on_event=_echo_handler))
        second = asyncio.create_task(client.call("ping", {}, timeout=300))
        request = await asyncio.wait_for(guest.requests.get(), BOUND_S)
        await asyncio.wait_for(guest.requests.get(), BOUND_S)
        # A well-formed frame first: the first line of a connection may be a torn one and is skipped.
        await guest.send(protocol.encode_frame(protocol.event(request["id"], "started", {"pid": 7})))
        await guest.send(HOSTILE[case](request["id"]))
        for call in (first, second):
            with pytest.raises(AgentUnavailable, match="broke the agent protocol"):
                await asyncio.wait_for(call, BOUND_S)
        assert client.closed
        with pytest.raises(AgentUnavailable, match="broke the agent protocol"):
            await client.call("ping", {}, timeout=BOUND_S)

    asyncio.run(_with_guest(tmp_path, body))
    assert len(violations) == 1, violations


def test_a_torn_first_line_is_skipped_and_the_answer_still_arrives(tmp_path: Path) -> None:
    async def body(client: AgentClient, guest: Guest) -> None:
        call = asyncio.create_task(client.call("ping", {}, timeout=BOUND_S))
        request = await asyncio.wait_for(guest.requests.get(), BOUND_S)
        await guest.send(b'fore a restore"}\n' + protocol.encode_frame(protocol.ok(request["id"], {"pong": True})))
        assert await call == {"pong": True}
        assert not client.closed

    asyncio.run(_with_guest(tmp_path, body))


def test_a_connect_cancelled_as_its_channel_opens_ends_cancelled(tmp_path: Path) -> None:
    """A cancel that reaches ``connect`` while it is pending is never lost: on Python 3.11, wait_for handed
    the just-opened connection back to a caller that had been cancelled (the spawner, a stopping daemon)."""
    async def scenario() -> None:
        path = str(tmp_path / "agent.sock")
        server = await asyncio.start_unix_server(lambda reader, writer: None, path=path)
        opened = asyncio.Event()

        class Vm:
            name = "sb-cancelled"

            async def open_agent(self, limit: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                streams = await asyncio.open_unix_connection(path, limit=limit)
                opened.set()
                return streams

        connecting = asyncio.create_task(AgentClient.connect(Vm()))  # type: ignore[arg-type]
        while not opened.is_set():
            await asyncio.sleep(0)
        accepted = connecting.cancel()  # False only when connect had already returned
        [outcome] = await asyncio.gather(connecting, return_exceptions=True)
        if isinstance(outcome, AgentClient):
            await outcome.close()
        server.close()
        assert connecting.cancelled() == accepted, f"a cancel was accepted, yet connect returned {outcome!r}"

    asyncio.run(scenario())


def test_a_call_cancelled_as_its_answer_arrives_ends_cancelled(tmp_path: Path) -> None:
    """What a daemon stopping mid-fork relies on: a child cancelled while its reseed is answered (or its VMM
    killed) ends cancelled, so it is reported as stopped, not as an agent that went away."""
    async def body(client: AgentClient, guest: Guest) -> None:
        call = asyncio.create_task(client.call("ping", {}, timeout=BOUND_S))
        request = await asyncio.wait_for(guest.requests.get(), BOUND_S)
        await asyncio.sleep(0.05)  # the call waits for its answer
        # The answer lands as the read loop hands it over (set directly: a socket cannot time it to the step).
        client._pending[request["id"]].done.set_result(protocol.ok(request["id"], {"pong": True}))
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(_with_guest(tmp_path, body))


def test_a_traced_call_has_the_hosts_and_the_guests_stages(tmp_path: Path) -> None:
    """The guest's marks come in any order (several guest threads and processes took them): they are
    put in time order, each ends a stage, and transport is the host's wait beyond the guest's span."""
    timings = Timings()

    async def body(client: AgentClient, guest: Guest) -> None:
        token = timings_module.CURRENT.set(timings)
        try:
            call = asyncio.create_task(client.call("eval", {}, timeout=BOUND_S))
        finally:
            timings_module.CURRENT.reset(token)
        request = await asyncio.wait_for(guest.requests.get(), BOUND_S)
        assert request["trace"] is True
        marks = [["read", 1_000_000], ["ctx_read", 1_500_000], ["ctx_sent", 1_700_000], ["handled", 3_000_000]]
        await guest.send(protocol.encode_frame({**protocol.ok(request["id"], {"value": "2"}), "trace": marks}))
        assert await call == {"value": "2"}
        untraced = asyncio.create_task(client.call("ping", {}, timeout=BOUND_S))
        request = await asyncio.wait_for(guest.requests.get(), BOUND_S)
        assert "trace" not in request
        await guest.send(protocol.encode_frame({**protocol.ok(request["id"], {}), "trace": [["x", "1"]]}))
        assert await untraced == {}  # a trace nobody asked for, of the wrong shape: ignored

    asyncio.run(_with_guest(tmp_path, body))
    stages = timings.stages()
    assert list(stages) == ["routed", "agent_sent", "agent_answer", "agent_resumed"]
    assert timings.elsewhere.keys() == {"guest.ctx_read", "guest.ctx_sent", "guest.handled", "guest", "transport"}
    assert round(timings.elsewhere["guest.ctx_sent"], 6) == 0.0002 and round(timings.elsewhere["guest"], 6) == 0.002
    host_wait = stages["agent_answer"]
    assert abs(timings.elsewhere["transport"] - (host_wait - 0.002)) < 1e-6


async def _stand_in_vmm() -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec("sleep", "300")


def test_a_sandbox_whose_guest_breaks_the_protocol_is_killed_and_released(tmp_path: Path, qemu_sandbox_service: Callable[[Paths, Registry], SandboxService]) -> None:
    paths = Paths(home=tmp_path, cache=tmp_path / "cache", socket=tmp_path / "forkd.sock")
    for directory in (paths.sandboxes, paths.snapshots):
        directory.mkdir(parents=True)
    registry = Registry(paths.db)
    service = qemu_sandbox_service(paths, registry)
    released: list[str] = []
    service.releasers.append(released.append)
    run_dir = paths.sandboxes / "sb-hostile000000"
    run_dir.mkdir()

    async def body(client: AgentClient, guest: Guest) -> None:
        process = await _stand_in_vmm()
        record = SandboxRecord("sb-hostile000000", "base", "running", process.pid, run_dir, time.time())
        registry.add_sandbox(record)
        vm = VmHandle(name=record.id, run_dir=run_dir, process=process, agent_socket=tmp_path / "agent.sock")
        live = service.watch(record, vm, client)
        call = asyncio.create_task(client.call("exec", {}, timeout=300))
        request = await asyncio.wait_for(guest.requests.get(), BOUND_S)
        await guest.send(_deep(200_000).replace(b'"id": 1', f'"id": {request["id"]}'.encode()))
        with pytest.raises(AgentUnavailable):
            await asyncio.wait_for(call, BOUND_S)
        assert live.watcher is not None
        await asyncio.wait_for(live.watcher, BOUND_S)
        assert process.returncode is not None  # the VMM was killed
        ended = service.lookup(record.id)
        assert (ended["status"], ended["exit_reason"]) == ("killed", "agent_protocol_violation")

    asyncio.run(_with_guest(tmp_path, body))
    assert released == ["sb-hostile000000"]
    assert registry.list_sandboxes() == [] and not run_dir.exists()
