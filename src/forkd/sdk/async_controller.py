"""``forkd.sdk.AsyncController``: the REST client for asyncio code, on ``httpx.AsyncClient``.

The same operations as ``Controller`` (both inherit ``operations.Operations``), each a coroutine here;
NDJSON answers are read line by line with ``aiter_lines`` and never block the event loop. ``ASYNC`` is
the async flavour: it runs the steps of ``Operations`` and of the sandbox core, awaiting each awaitable.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import IO, Any, TypeVar

import httpx

from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.answers import StreamState, raise_for, reaching, truncated
from forkd.sdk.calls import Call, fork_call, read_file_call
from forkd.sdk.operations import Operations
from forkd.sdk.retry import busy_pauses, is_busy, pause_for, resendable
from forkd.sdk.sandbox.flavour import UPLOAD_PIECE_BYTES, Flavour, Steps, AsyncSide, upload_piece

T = TypeVar("T")


async def maybe_await(outcome: Any) -> Any:
    """A callback's answer: awaited when the callback was a coroutine function."""
    return await outcome if inspect.isawaitable(outcome) else outcome


async def run(steps: Steps[Any]) -> Any:
    """Await what the steps yield; an error is thrown back in where it was yielded, so their
    ``try``/``except``/``finally`` handle it as they would in the sync flavour."""
    try:
        pending = next(steps)
        while True:
            try:
                answer = await maybe_await(pending)
            except BaseException as exc:  # noqa: BLE001 - handed to the steps, which re-raise what they do not handle
                pending = steps.throw(exc)
            else:
                pending = steps.send(answer)
    except StopIteration as done:
        return done.value


async def _collect(items: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in items]


async def _pieces(file: IO[Any]) -> AsyncIterator[bytes]:
    """A file object's upload pieces, each read in a worker thread (a file read blocks)."""
    while piece := await asyncio.to_thread(file.read, UPLOAD_PIECE_BYTES):
        yield upload_piece(piece)


ASYNC = Flavour(run=run, iterate=aiter, next=lambda iterator: anext(iterator, None), collect=_collect,
                close=lambda iterator: iterator.aclose(), pieces=_pieces, sleep=asyncio.sleep)


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
            with reaching(url):
                response: httpx.Response = await context.__aenter__()
            if not response.is_success:
                await response.aread()
                raise_for(response)
        except BaseException:
            await _exit(context)
            raise
        return cls(context, response, url)

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        try:
            with reaching(self._url):
                async for text in self._lines:
                    if (event := self.take(text)) is not None:
                        yield event
                    elif self.done:
                        return
        finally:
            await self.close()
        raise truncated()

    async def close(self) -> None:
        await _exit(self._context)


async def _exit(context: Any) -> None:
    with contextlib.suppress(Exception):
        await context.__aexit__(None, None, None)


class AsyncController(Operations, AsyncSide):
    """Asynchronous client for the forkd REST API: ``await api.sandboxes()`` and every other operation."""

    _flavour = ASYNC
    _new_client = staticmethod(ConnectionConfig.async_client)

    async def close(self) -> None:
        """Close the HTTP connection (sandboxes keep running)."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncController:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request and answer its JSON (for calls ``Operations`` does not name); a ``busy`` refusal
        is sent again after the daemon's ``Retry-After`` or a backoff (``retry.py``), unless the body streams."""
        for pause in busy_pauses():
            with reaching(self.url):
                response = await self._http.request(method, path, **kwargs)
            if pause is None or not is_busy(response) or not resendable(kwargs.get("content")):
                break
            await asyncio.sleep(pause_for(response, pause))
        raise_for(response)
        return response.json()

    async def _send(self, call: Call[T]) -> T:
        return call.parse(await self.request(call.method, call.path, **call.options()))

    async def _open_stream(self, call: Call[Any]) -> AsyncEventStream:
        return await AsyncEventStream.open(self._http.stream(call.method, call.path, **call.options()), self.url)

    async def _stream(self, call: Call[Any], on_line: Callable[[dict[str, Any]], Any] | None) -> Any:
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

    async def read_file_chunks(self, sandbox_id: str, path: str) -> AsyncGenerator[bytes, None]:
        """The file's bytes as they arrive (a large file is never held whole)."""
        call = read_file_call(sandbox_id, path)
        with reaching(self.url):
            async with self._http.stream(call.method, call.path, **call.options()) as response:
                if not response.is_success:
                    await response.aread()
                    raise_for(response)
                async for chunk in response.aiter_bytes():
                    yield chunk
