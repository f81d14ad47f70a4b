"""Any other port of a sandbox: HTTP and WebSocket traffic relayed to the program listening on it.

E2B's proxy forwards ``{port}-{sandboxID}.{domain}`` (and the ``E2b-Sandbox-Port`` header) to
that port in the sandbox. Here each request or WebSocket goes through a runtime tunnel
(runtime/tunnels.py: a byte stream the guest agent relays to the port on the guest's loopback), so
it works for every child, ``net=none`` ones included. HTTP is spoken to the guest with h11, one
request per connection; a WebSocket is accepted from the client once the guest accepted it (wsproto
on the guest side), then messages are relayed both ways. What the guest answers is hostile: its
response head is bounded by h11, a WebSocket message by ``MAX_MESSAGE_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import h11
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from wsproto import ConnectionType, WSConnection
from wsproto import events as ws

from forkd.errors import kind_for
from forkd.runtime.tunnels import Tunnel, Tunnels

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_HEAD_BYTES = 64 * 1024
# Not forwarded: hop-by-hop headers, and the sandbox's credentials and routing, which are the front's.
_DROPPED = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                      b"upgrade", b"x-access-token", b"e2b-traffic-access-token", b"e2b-sandbox-id",
                      b"e2b-sandbox-port", b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
                      b"sec-websocket-protocol"})
_BODILESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})


class PortClosed(Exception):
    """Nothing answered on the port, or it broke HTTP."""


def _unreachable(sandbox_id: str, port: int, exc: BaseException) -> JSONResponse:
    """E2B's proxy answer for a port nobody listens on: 502 naming the port."""
    reason = getattr(exc, "message", None) or str(exc)
    status = 503 if kind_for(exc) == "busy" else 502
    return JSONResponse({"code": status, "message": f"The sandbox {sandbox_id} is running but port {port} is not "
                                                    f"open or did not answer: {reason}", "sandboxId": sandbox_id,
                         "port": port}, status_code=status)


def _forwarded(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(key, value) for key, value in headers if key.lower() not in _DROPPED]


async def _next_event(conn: h11.Connection, tunnel: Tunnel) -> Any:
    """The next h11 event from the guest, reading the tunnel as needed."""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise PortClosed(f"the program on the port broke HTTP: {exc}") from None
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await tunnel.read())


class _Relayed(StreamingResponse):
    """A response streamed from a tunnel, which is closed however the response ends: a client that
    left before its body began never starts the body's generator, whose own ``finally`` would not run."""

    def __init__(self, tunnel: Tunnel, body: AsyncIterator[bytes], status_code: int) -> None:
        super().__init__(body, status_code=status_code)
        self.tunnel = tunnel

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.tunnel.close()


class Ports:
    def __init__(self, tunnels: Tunnels) -> None:
        self.tunnels = tunnels

    async def http(self, request: Request, sandbox_id: str, port: int) -> Response:
        """Relay one HTTP request to the port and stream the program's answer back."""
        try:
            tunnel = await self.tunnels.open(sandbox_id, port)
        except Exception as exc:
            return _unreachable(sandbox_id, port, exc)
        try:
            conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
            headers = _forwarded(request.scope["headers"])
            has_body = request.method not in _BODILESS or any(k == b"content-length" for k, _ in headers)
            if has_body and not any(k == b"content-length" for k, _ in headers):
                headers.append((b"transfer-encoding", b"chunked"))
            headers.append((b"connection", b"close"))
            target = request.scope.get("raw_path") or request.url.path.encode()
            if request.scope.get("query_string"):
                target += b"?" + request.scope["query_string"]
            await tunnel.write(conn.send(h11.Request(method=request.method, target=target, headers=headers)))
            if has_body:
                async for chunk in request.stream():
                    if chunk:
                        await tunnel.write(conn.send(h11.Data(data=chunk)))
            await tunnel.write(conn.send(h11.EndOfMessage()))
            while isinstance(head := await _next_event(conn, tunnel), h11.InformationalResponse):
                pass
            if not isinstance(head, h11.Response):
                raise PortClosed("the program on the port closed the connection without answering")
        except Exception as exc:
            tunnel.close()
            return _unreachable(sandbox_id, port, exc)
        response = _Relayed(tunnel, self._body(conn, tunnel), status_code=head.status_code)
        response.raw_headers = _forwarded(list(head.headers))  # repeated ones (Set-Cookie) kept as they are
        return response

    @staticmethod
    async def _body(conn: h11.Connection, tunnel: Tunnel) -> AsyncIterator[bytes]:
        while isinstance(event := await _next_event(conn, tunnel), h11.Data):
            yield bytes(event.data)

    async def websocket(self, scope: dict[str, Any], receive: Any, send: Any, sandbox_id: str, port: int) -> None:
        """Open the WebSocket on the guest's port first, accept the client's with its answer, then relay."""
        try:
            tunnel = await self.tunnels.open(sandbox_id, port)
        except Exception:
            await send({"type": "websocket.close", "code": 1011})
            return
        try:
            guest = WSConnection(ConnectionType.CLIENT)
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "localhost")
            target = scope.get("raw_path") or scope["path"].encode()
            if scope.get("query_string"):
                target += b"?" + scope["query_string"]
            extra = [(k, v) for k, v in _forwarded(scope["headers"]) if k != b"host"]
            await tunnel.write(guest.send(ws.Request(host=host, target=target.decode("latin-1"), extra_headers=extra,
                                                     subprotocols=list(scope.get("subprotocols") or []))))
            answer = await self._handshake(guest, tunnel)
            if not isinstance(answer, ws.AcceptConnection):
                await send({"type": "websocket.close", "code": 1011})
                return
            await send({"type": "websocket.accept", "subprotocol": answer.subprotocol})
            relays = [asyncio.create_task(self._to_guest(guest, tunnel, receive)),
                      asyncio.create_task(self._to_client(guest, tunnel, send))]
            try:
                await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for relay in relays:
                    relay.cancel()
                await asyncio.gather(*relays, return_exceptions=True)
        finally:
            tunnel.close()

    @staticmethod
    async def _handshake(guest: WSConnection, tunnel: Tunnel) -> ws.Event | None:
        seen = 0
        while True:
            for event in guest.events():
                return event
            data = await tunnel.read()
            seen += len(data)
            if not data or seen > MAX_HEAD_BYTES:
                return None
            guest.receive_data(data)

    @staticmethod
    async def _to_guest(guest: WSConnection, tunnel: Tunnel, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                with contextlib.suppress(Exception):
                    await tunnel.write(guest.send(ws.CloseConnection(code=message.get("code", 1000))))
                return
            if message.get("text") is not None:
                await tunnel.write(guest.send(ws.Message(data=message["text"])))
            elif message.get("bytes") is not None:
                await tunnel.write(guest.send(ws.Message(data=message["bytes"])))

    @staticmethod
    async def _to_client(guest: WSConnection, tunnel: Tunnel, send: Any) -> None:
        parts: list[Any] = []
        size = 0
        while True:
            data = await tunnel.read()
            guest.receive_data(data or None)
            for event in guest.events():
                if isinstance(event, ws.Message):
                    parts.append(event.data)
                    size += len(event.data)
                    if size > MAX_MESSAGE_BYTES:
                        await send({"type": "websocket.close", "code": 1009})
                        return
                    if event.message_finished:
                        joined = "".join(parts) if isinstance(event, ws.TextMessage) else b"".join(parts)
                        key = "text" if isinstance(event, ws.TextMessage) else "bytes"
                        await send({"type": "websocket.send", key: joined})
                        parts, size = [], 0
                elif isinstance(event, ws.Ping):
                    await tunnel.write(guest.send(event.response()))
                elif isinstance(event, ws.CloseConnection):
                    with contextlib.suppress(Exception):
                        await tunnel.write(guest.send(event.response()))
                    await send({"type": "websocket.close", "code": event.code})
                    return
            if not data:
                await send({"type": "websocket.close", "code": 1011})  # the program dropped the connection
                return

