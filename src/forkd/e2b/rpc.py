"""Serving Connect RPCs over ASGI: the method table and the three call shapes envd uses.

A unary method returns one message; a server-streaming method yields messages (sent as envelopes,
then the end-of-stream frame, errors included, since the status is already 200); a
client-streaming method receives an async iterator of messages and returns one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from forkd.e2b import connect
from forkd.e2b.errors import ConnectError, to_connect
from forkd.runtime.sandboxes import LiveSandbox

Message = dict[str, Any]
log = logging.getLogger("forkd.e2b")


@dataclass(frozen=True)
class Call:
    """What a method gets besides its message(s): the sandbox and the request's headers."""

    live: LiveSandbox
    request: Request


Unary = Callable[[Call, Message], Awaitable[Message]]
# A server stream checks its request before answering: errors raised by the awaited call end the
# stream at once; the iterator it returns yields the messages.
ServerStream = Callable[[Call, Message], Awaitable[AsyncIterator[Message]]]
ClientStream = Callable[[Call, AsyncIterator[Message]], Awaitable[Message]]


@dataclass(frozen=True)
class Method:
    kind: Literal["unary", "server_stream", "client_stream"]
    handler: Unary | ServerStream | ClientStream


def _error_response(error: ConnectError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def serve(methods: dict[str, Method], path: str, call: Call) -> Response:
    """Answer one RPC at ``/package.Service/Method``; an unknown one is ``unimplemented``."""
    method = methods.get(path)
    if method is None:
        return _error_response(ConnectError("unimplemented", f"no RPC {path.lstrip('/')!r} here; envd {path} "
                                                              "is not implemented by forkd"))
    expected = connect.UNARY_TYPE if method.kind == "unary" else connect.STREAM_TYPE
    if _media_type(call.request) != expected:
        return _error_response(ConnectError("invalid_argument", f"{path.lstrip('/')} takes content-type {expected} "
                                                                 "(Connect protocol, JSON codec)"))
    if method.kind == "unary":
        try:
            message = await connect.read_unary(call.request.stream())
            return JSONResponse(await method.handler(call, message))  # type: ignore[misc]
        except Exception as exc:
            return _error_response(_logged(exc, path))
    if method.kind == "client_stream":
        try:
            answer = await method.handler(call, connect.read_envelopes(call.request.stream()))  # type: ignore[arg-type]
            body = connect.envelope(answer) + connect.end_stream()
        except Exception as exc:
            body = connect.end_stream(_logged(exc, path))
        return Response(body, media_type=connect.STREAM_TYPE)
    try:  # server stream: the request is one enveloped message, refused as soon as a second one comes
        messages: list[Message] = []
        async for message in connect.read_envelopes(call.request.stream()):
            if messages:
                raise ConnectError("invalid_argument", "a server-streaming call takes one request message, not more")
            messages.append(message)
        if not messages:
            raise ConnectError("invalid_argument", "a server-streaming call takes one request message, not none")
    except ConnectError as exc:
        return StreamingResponse(iter([connect.end_stream(exc)]), media_type=connect.STREAM_TYPE)
    return StreamingResponse(_frames(method.handler(call, messages[0]), path),  # type: ignore[arg-type]
                             media_type=connect.STREAM_TYPE)


async def _frames(opening: Awaitable[AsyncIterator[Message]], path: str) -> AsyncIterator[bytes]:
    try:
        async for message in await opening:
            yield connect.envelope(message)
    except Exception as exc:
        yield connect.end_stream(_logged(exc, path))
        return
    yield connect.end_stream()


def _logged(exc: BaseException, path: str) -> ConnectError:
    error = to_connect(exc)
    if error.code == "internal":
        log.error("RPC %s failed", path, exc_info=exc)
    return error
