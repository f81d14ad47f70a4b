"""A sandbox's own ports through the E2B front, with the real front, runtime and guest agent over the
FakeVmm (whose agent runs on the host, so a "guest port" is a listener of this test on loopback):
HTTP relayed both ways through a tunnel, the traffic token required unless the sandbox was created
public, a closed port answered as E2B's proxy does, and tunnels bounded per sandbox and in bytes."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from free_ports import free_port
from test_e2b_tenants import A, KEYS, SECRET, _client, _key, _to
from test_runtime_fake_vmm import _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.daemon.middleware.body_limit import BodyLimit
from forkd.e2b import app as e2b_app
from forkd.e2b.app import E2BFront
from forkd.e2b.keys import Credentials
from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient
from forkd.runtime.tunnels import Tunnels, TunnelsBusy
from forkd.vmm.fake import FakeVmm


@contextlib.asynccontextmanager
async def _real_agent(directory: Path) -> AsyncIterator[AgentClient]:
    """The real guest agent in a subprocess (the FakeVmm's own agent is a stand-in that relays nothing)."""
    path = directory / "agent.sock"
    connected: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    server = await asyncio.start_unix_server(lambda r, w: connected.put_nowait((r, w)), str(path),
                                             limit=protocol.MAX_FRAME_BYTES + 1)
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "forkd.guest.agent", "--transport",
                                                   f"unix:{path}")
    try:
        client = AgentClient(*await asyncio.wait_for(connected.get(), 30))
        try:
            yield client
        finally:
            await client.close()
    finally:
        process.kill()
        await process.wait()
        server.close()


class _Lookup:
    """Every sandbox id answers with the real agent."""

    def __init__(self, agent: AgentClient) -> None:
        self.agent = agent

    def get(self, sandbox_id: str) -> _Lookup:
        return self


async def _serve(handler: Any) -> tuple[asyncio.AbstractServer, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _http_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A tiny HTTP server: answers with the request's method, path, one header and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    seen = "|".join([lines[0], headers.get("x-probe", ""), "token" if "x-access-token" in
                     {k.lower() for k in headers} else "no-token"]).encode() + b"|" + body
    writer.write(b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n"
                 b"Content-Length: " + str(len(seen)).encode() + b"\r\n\r\n" + seen)
    await writer.drain()
    writer.close()


def test_a_guest_port_answers_through_the_front_with_its_token_or_when_public(tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port = await _serve(_http_echo)
        runtime = await _runtime(tmp_path, FakeVmm())
        front = E2BFront(runtime, Credentials(KEYS, SECRET))
        app = BodyLimit(front, is_upload=e2b_app.is_upload, is_stream=e2b_app.is_stream, shape=e2b_app.refusal_shape)
        try:
            async with _real_agent(tmp_path) as agent, _client(app) as client:
                front.ports.tunnels = Tunnels(_Lookup(agent))
                made = (await client.post("/sandboxes", headers=_key(A), json={"templateID": "base"})).json()
                sandbox, token = made["sandboxID"], made["trafficAccessToken"]
                assert made["domain"] is None  # no domain configured in this front
                headers = {**_to(sandbox, port, token, "E2B-Traffic-Access-Token"), "X-Probe": "p1"}
                answer = await client.post("/some/path?q=1", headers=headers, content=b"hello")
                assert answer.status_code == 201, answer.text
                assert answer.text == "POST /some/path?q=1 HTTP/1.1|p1|no-token|hello"  # the token stays here
                assert answer.headers.get_list("set-cookie") == ["a=1", "b=2"]
                by_host = await client.get("/x", headers={"Host": f"{port}-{sandbox}.localhost:3000",
                                                          "X-Access-Token": token})
                assert by_host.status_code == 201 and by_host.text.startswith("GET /x HTTP/1.1")

                for given in (None, "0" * 64):
                    refused = await client.get("/", headers=_to(sandbox, port, given))
                    assert refused.status_code == 401, refused.text
                closed = await client.get("/", headers=_to(sandbox, free_port(), token))
                assert closed.status_code == 502 and "is not open" in closed.json()["message"]
                assert front.ports.tunnels.count(sandbox) == 0  # every answered request closed its tunnel

                public = (await client.post("/sandboxes", headers=_key(A), json={
                    "templateID": "base", "network": {"allowPublicTraffic": True}})).json()
                tokenless = await client.get("/open", headers=_to(public["sandboxID"], port))
                assert tokenless.status_code == 201 and tokenless.text.startswith("GET /open")
                envd = await client.post("/filesystem.Filesystem/Stat", json={"path": "/"},
                                         headers=_to(public["sandboxID"], 49983))
                assert envd.status_code == 401  # a public sandbox's envd still needs the token
        finally:
            await runtime.stop()
            server.close()

    run(scenario)


def test_tunnels_are_bounded_per_sandbox_and_a_flood_is_paused_in_the_guest(tmp_path: Path) -> None:
    sent: list[int] = []

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chunk = b"x" * 65536
        try:
            for _ in range(512):  # 32 MiB, if anyone read it
                writer.write(chunk)
                await writer.drain()
                sent.append(len(chunk))
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def scenario() -> None:
        server, port = await _serve(flood)
        try:
            async with _real_agent(tmp_path) as agent:
                tunnels, sandbox = Tunnels(_Lookup(agent), max_per_sandbox=2, buffer_bytes=128 * 1024), "sb-any"
                first = await tunnels.open(sandbox, port)
                second = await tunnels.open(sandbox, port)
                with pytest.raises(TunnelsBusy):
                    await tunnels.open(sandbox, port)
                await asyncio.sleep(1.0)  # let the flood fill what it may while nobody reads
                # The agent stopped reading the stalled tunnels' sockets: the server is stuck far below
                # its 32 MiB (a relay that kept reading takes it all in well under the second): kernel
                # socket buffers (the sender's up to tcp_wmem's 4 MiB, the receiver's as autotuned: ~8.5 MiB
                # for both tunnels on a 6.18 kernel) and at most four host buffers per tunnel.
                assert sum(sent) < 16 * 1024 * 1024, sum(sent)
                got = 0
                while got < 2 * 1024 * 1024:  # reading resumes the guest side
                    data = await first.read()
                    assert data, "the flood ended early"
                    got += len(data)
                first.close()
                second.close()
                assert tunnels.count(sandbox) == 0
                third = await tunnels.open(sandbox, port)  # closed ones free their slots
                third.close()
        finally:
            server.close()

    run(scenario)
