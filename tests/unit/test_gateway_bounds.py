"""The cluster E2B gateway's bounds against nodes that hang while Ray still counts them alive.

The gateway (``forkd.cluster.e2b_gateway``) is served by uvicorn on loopback as ``forkd cluster e2b``
serves it; the nodes behind it are real HTTP servers: one that accepts connections and never answers
a byte, and small E2B fronts whose streams go quiet, with or without their health check answering.
The cluster is a stand-in for ``Cluster`` (the directory the gateway reads, no Ray): what is tested
here is the gateway's own logic, its timeouts and the errors it answers
(tests/unit/test_cluster_e2b.py runs it on a real Ray cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from conftest import run_bounded, served_on_loopback
from forkd.cluster.e2b_gateway import ENVD_PORT, Gateway
from forkd.cluster.e2b_view import ClusterView
from forkd.cluster.placement import NodeState

T = TypeVar("T")
IDLE_S = 0.5  # the gateway's idle bound in these tests (its default is 30 s)
PROBE_S = 0.5
QUIET_S = 4 * IDLE_S  # how long a quiet node's stream says nothing
CONNECT_FRAME = "application/connect+json"


def run(make: Callable[[], Awaitable[T]]) -> T:
    return run_bounded(make, 60.0)  # type: ignore[no-any-return]


class StandInCluster:
    """What ``ClusterView`` reads of a ``Cluster``: a directory of nodes given by hand, nobody dead."""

    def __init__(self, nodes: list[NodeState]) -> None:
        self.directory = SimpleNamespace(nodes={node.ray_node_id: node for node in nodes})
        self.deaths: list[str] = []

    def refresh(self) -> None:
        pass

    def notice_deaths(self, wait_for: str | None = None) -> list[str]:
        return []

    def close(self) -> None:
        pass


def node_at(name: str, url: str) -> NodeState:
    return NodeState(ray_node_id=f"ray-{name}", node_id=name, url=url, token=None, compat_key="c", compat={},
                     slots_free=1, max_sandboxes=0, live=0, e2b_url=url)


@contextlib.asynccontextmanager
async def never_answering() -> AsyncIterator[str]:
    """A node whose front accepts connections and reads requests but never answers a byte."""
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def connect_frame(message: dict[str, Any], end: bool = False) -> bytes:
    body = json.dumps(message).encode()
    return (b"\x02" if end else b"\x00") + len(body).to_bytes(4, "big") + body


def frames(data: bytes) -> list[tuple[int, dict[str, Any]]]:
    found = []
    while data:
        flags, size = data[0], int.from_bytes(data[1:5], "big")
        found.append((flags, json.loads(data[5:5 + size])))
        data = data[5 + size:]
    return found


def quiet_front(hangs: asyncio.Event) -> Starlette:
    """A node's E2B front whose answers go quiet for ``QUIET_S`` after their first chunk; once ``hangs``
    is set its health check never answers either (a front whose loop is stuck)."""
    forever = asyncio.Event()

    async def health(_: Request) -> Response:
        if hangs.is_set():
            await forever.wait()
        return JSONResponse({"ok": True})

    async def stream(first: bytes, last: bytes) -> AsyncIterator[bytes]:
        yield first
        await asyncio.sleep(QUIET_S)
        if hangs.is_set():
            await forever.wait()
        yield last

    async def start(_: Request) -> Response:  # envd's process Start: a Connect server stream
        return StreamingResponse(stream(connect_frame({"event": {"start": {"pid": 7}}}),
                                        connect_frame({"event": {"end": {"exitCode": 0}}}) + connect_frame({}, end=True)),
                                 media_type=CONNECT_FRAME)

    async def execute(_: Request) -> Response:  # the code interpreter's cell: NDJSON lines
        return StreamingResponse(stream(b'{"type": "stdout", "text": "a"}\n', b'{"type": "end_of_execution"}\n'),
                                 media_type="application/x-ndjson")

    async def download(_: Request) -> Response:  # envd's file download: bytes, no error it could carry
        return StreamingResponse(stream(b"x" * 1000, b"y" * 1000), media_type="application/octet-stream")

    return Starlette(routes=[Route("/health", health), Route("/process.Process/Start", start, methods=["POST"]),
                             Route("/execute", execute, methods=["POST"]), Route("/files", download)])


@contextlib.asynccontextmanager
async def gateway(nodes: list[NodeState], sandbox: str, on: NodeState, control_s: float = 120.0) -> AsyncIterator[str]:
    """The gateway in front of ``nodes``, knowing ``sandbox`` runs ``on`` one of them."""
    view = ClusterView(StandInCluster(nodes))  # type: ignore[arg-type]
    view.remember(sandbox, on)
    async with served_on_loopback(Gateway(view, control_s=control_s, idle_s=IDLE_S, probe_s=PROBE_S)) as url:
        yield url


def traffic(sandbox: str, port: str = ENVD_PORT) -> dict[str, str]:
    return {"e2b-sandbox-id": sandbox, "e2b-sandbox-port": port, "x-access-token": "t"}


def test_sandbox_traffic_to_a_node_that_never_answers_is_a_502_naming_the_node() -> None:
    async def scenario() -> None:
        async with never_answering() as hung_url:
            hung = node_at("hung-1", hung_url)
            async with gateway([hung], "sb-stuck", hung) as url, httpx.AsyncClient(timeout=15) as client:
                started = asyncio.get_running_loop().time()
                answer = await client.get(f"{url}/files", params={"path": "/etc/hostname"}, headers=traffic("sb-stuck"))
                waited = asyncio.get_running_loop().time() - started
        assert answer.status_code == 502
        message = answer.json()["message"]
        assert answer.json()["code"] == 502 and "hung-1" in message and "sb-stuck" in message, message
        assert waited < IDLE_S + PROBE_S + 3, waited

    run(scenario)


def test_a_control_plane_call_to_a_node_that_never_answers_ends_at_its_bound() -> None:
    async def scenario() -> None:
        async with never_answering() as hung_url:
            hung = node_at("hung-2", hung_url)
            async with gateway([hung], "sb-stuck", hung, control_s=1.0) as url, \
                    httpx.AsyncClient(timeout=15) as client:
                answer = await client.get(f"{url}/sandboxes/sb-stuck", headers={"x-api-key": "k"})
        assert answer.status_code == 502, answer.text
        assert "hung-2" in answer.json()["message"] and "did not answer" in answer.json()["message"]

    run(scenario)


@pytest.mark.parametrize("path", ["/process.Process/Start", "/execute", "/files"])
def test_a_quiet_stream_goes_on_while_its_node_answers_its_health_check(path: str) -> None:
    async def scenario() -> None:
        async with served_on_loopback(quiet_front(asyncio.Event())) as front:
            quiet = node_at("quiet", front)
            async with gateway([quiet], "sb-q", quiet) as url, httpx.AsyncClient(timeout=15) as client:
                method = "GET" if path == "/files" else "POST"
                answer = await client.request(method, f"{url}{path}", headers=traffic("sb-q"), content=b"{}")
        assert answer.status_code == 200
        if path == "/process.Process/Start":
            assert [flags for flags, _ in frames(answer.content)] == [0, 0, 2]
        elif path == "/execute":
            assert answer.content.endswith(b'{"type": "end_of_execution"}\n')
        else:
            assert answer.content == b"x" * 1000 + b"y" * 1000

    run(scenario)


def test_a_stream_whose_node_hangs_ends_with_an_error_in_its_own_format() -> None:
    """A Connect stream ends with Connect's end-of-stream error, a code cell with an ``error`` line, a
    download is cut short: each within the idle bound and the health check's."""
    async def scenario() -> None:
        hangs = asyncio.Event()
        hangs.set()
        async with served_on_loopback(quiet_front(hangs)) as front:
            stuck = node_at("stuck-3", front)
            async with gateway([stuck], "sb-h", stuck) as url, httpx.AsyncClient(timeout=15) as client:
                started = asyncio.get_running_loop().time()
                started_stream = await client.post(f"{url}/process.Process/Start", headers=traffic("sb-h"),
                                                   content=b"{}")
                cell = await client.post(f"{url}/execute", headers=traffic("sb-h", "49999"), content=b"{}")
                with pytest.raises(httpx.RemoteProtocolError):
                    await client.get(f"{url}/files", headers=traffic("sb-h"))
                waited = asyncio.get_running_loop().time() - started
        (_, start), (flags, end) = frames(started_stream.content)
        assert start == {"event": {"start": {"pid": 7}}} and flags == 2
        assert end["error"]["code"] == "unavailable" and "stuck-3" in end["error"]["message"], end
        lines = [json.loads(line) for line in cell.content.splitlines()]
        assert lines[0]["type"] == "stdout" and lines[1]["type"] == "error" and "stuck-3" in lines[1]["value"]
        assert waited < 3 * (IDLE_S + PROBE_S) + 5, waited

    run(scenario)


def test_more_quiet_streams_than_a_connection_pool_holds_all_go_on() -> None:
    """Streams hold their connections to the node; the health check must not queue behind them (and
    read a busy node as a hung one): 110 quiet cells at once, more than httpx's default pool of 100."""
    async def scenario() -> None:
        async with served_on_loopback(quiet_front(asyncio.Event())) as front:
            quiet = node_at("busy", front)
            async with gateway([quiet], "sb-many", quiet) as url, \
                    httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None)) as client:
                answers = await asyncio.gather(*(client.post(f"{url}/execute", headers=traffic("sb-many", "49999"),
                                                             content=b"{}") for _ in range(110)))
        assert all(a.status_code == 200 and a.content.endswith(b'{"type": "end_of_execution"}\n') for a in answers), \
            sorted({(a.status_code, a.content[-200:]) for a in answers})

    run(scenario)
