"""``forkd.sdk.AsyncController``: the REST client for asyncio code, on ``httpx.AsyncClient``.

The same operations as ``Controller`` (both inherit ``operations.Operations``), each a coroutine here;
NDJSON answers are read line by line with ``aiter_lines`` and never block the event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import httpx

from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.errors import DaemonUnreachable
from forkd.sdk.operations import (
    Call,
    Operations,
    StreamState,
    append_bounded,
    fork_call,
    raise_for,
    read_file_call,
    truncated,
)


async def maybe_await(outcome: Any) -> Any:
    """A callback's answer: awaited when the callback was a coroutine function."""
    return await outcome if inspect.isawaitable(outcome) else outcome


class AsyncEventStream(StreamState):
    """An NDJSON answer being read: ``async for`` its events; ``result`` is set once the last line came."""

    def __init__(self, context: Any, response: httpx.Response, url: str) -> None:
        self._context = context
        self._response = response
        self._url = url
        super().__init__()
        self._lines = response.aiter_lines()

    @classmethod
    async def open(cls, context: Any, url: str) -> AsyncEventStream:
        try:
            response: httpx.Response = await context.__aenter__()
            if not response.is_success:
                await response.aread()
                raise_for(response)
        except httpx.TransportError as exc:
            await _exit(context)
            raise DaemonUnreachable(url, str(exc) or type(exc).__name__) from None
        except BaseException:
            await _exit(context)
            raise
        return cls(context, response, url)

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for text in self._lines:
                if (event := self.take(text)) is not None:
                    yield event
                elif self.done:
                    return
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self._url, str(exc) or type(exc).__name__) from None
        finally:
            await self.close()
        raise truncated()

    async def close(self) -> None:
        await _exit(self._context)


async def _exit(context: Any) -> None:
    with contextlib.suppress(Exception):
        await context.__aexit__(None, None, None)


class AsyncController(Operations):
    """Asynchronous client for the forkd REST API: ``await api.sandboxes()`` and every other operation."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float | None = None, *,
                 connection: ConnectionConfig | None = None, http: httpx.AsyncClient | None = None) -> None:
        """As ``Controller``; ``http`` is a ready ``httpx.AsyncClient`` to send through instead."""
        self.connection = ConnectionConfig.resolve(connection, url, token)
        if timeout is not None:
            self.connection = dataclasses.replace(self.connection, request_timeout=timeout)
        self.url = self.connection.url
        self._http = http or self.connection.async_client()

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncController:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request and answer its JSON (for calls ``Operations`` does not name)."""
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None
        raise_for(response)
        return response.json()

    async def _send(self, call: Call) -> Any:
        return call.parse(await self.request(call.method, call.path, **call.options()))

    async def _open_stream(self, call: Call) -> AsyncEventStream:
        return await AsyncEventStream.open(self._http.stream(call.method, call.path, **call.options()), self.url)

    async def _stream(self, call: Call, on_line: Callable[[dict[str, Any]], Any] | None) -> Any:
        events = await self._open_stream(call)
        async for line in events:
            if on_line is not None:
                await maybe_await(on_line(line))
        return events.result

    async def fork_iter(self, tag: str, n: int = 1, **options: Any) -> AsyncIterator[dict[str, Any]]:
        """As ``Controller.fork_iter``: each child as it answers or fails."""
        async for line in await self._open_stream(fork_call(tag, n, options).streamed()):
            if "child" in line:
                yield line["child"]

    async def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> bytes:
        """As ``Controller.read_file``: the whole file, refused past ``max_bytes``."""
        data = bytearray()
        chunks = self.read_file_chunks(sandbox_id, path)
        try:
            async for chunk in chunks:
                append_bounded(data, chunk, max_bytes, path)
        finally:
            await chunks.aclose()  # stops the download where it is
        return bytes(data)

    async def read_file_chunks(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        """The file's bytes as they arrive (a large file is never held whole)."""
        call = read_file_call(sandbox_id, path)
        try:
            async with self._http.stream(call.method, call.path, **call.options()) as response:
                if not response.is_success:
                    await response.aread()
                    raise_for(response)
                async for chunk in response.aiter_bytes():
                    yield chunk
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None
