"""NDJSON answers: one JSON object per line, ``progress``/``event`` lines first, then one ``result`` or
``error`` line.

Two kinds. :func:`detached` runs work that must finish even if the client leaves (an image build,
a snapshot being written: abandoning it midway would leave half a thing); its progress lines wait in
a bounded queue, the oldest progress dropped first. :func:`attached` streams events of a call that
lives only as long as its client: a reader that stops reading stops pulling events (back-pressure
reaches the guest), and a client that disconnects ends the call.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

from forkd.daemon.errors import error_body
from forkd.packs.meter import Measured

NDJSON = "application/x-ndjson"
CLOSE_TIMEOUT_S = 30.0  # ending a streamed call in the guest (cancel, or a kill) takes at most this
_closing: set[asyncio.Task[None]] = set()  # streams being closed after their client left
MAX_QUEUED_PROGRESS = 1000  # progress lines waiting for a slow client; older ones are dropped
_DOC = {"schema": {"type": "string", "description": "one JSON object per line: progress or event lines, "
                                                     "then one {\"result\": ...} or {\"error\": ...} line"}}
# How the routes that always answer NDJSON are documented.
NDJSON_ANSWER: dict[int | str, dict[str, Any]] = {200: {"content": {NDJSON: _DOC}, "description": "NDJSON"}}


def progress_line(line: str) -> dict[str, Any]:
    """``{"progress": text}``, with ``done_bytes`` and ``total_bytes`` (null when unknown) when the line counts bytes."""
    if isinstance(line, Measured):
        return {"progress": str(line), "done_bytes": line.done, "total_bytes": line.total}
    return {"progress": line}


def json_or_ndjson(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """How a route answering ``model`` as JSON, or NDJSON events with ``"stream": true``, is documented."""
    return {200: {"model": model, "content": {NDJSON: _DOC},
                  "description": "JSON, or NDJSON events with \"stream\": true"}}


class NDJSONResponse(StreamingResponse):
    media_type = NDJSON

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:  # the client left or the answer ended: end the generator (and what it streams) now
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                # In a task of its own: Starlette cancels this one when the client disconnects, and
                # its cancel scope would cancel the cleanup's awaits too. Bounded: a stuck guest
                # cannot hold it.
                closing = asyncio.create_task(asyncio.wait_for(close(), CLOSE_TIMEOUT_S))
                _closing.add(closing)
                closing.add_done_callback(_closing.discard)


def _line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item) + "\n").encode()


def detached(work: Callable[[Callable[[dict[str, Any]], None]], Awaitable[Any]]) -> NDJSONResponse:
    """Run ``work(emit)`` to its end whatever the client does; stream what it emits, then its outcome.

    ``emit`` may be called from worker threads.
    """
    loop = asyncio.get_running_loop()
    queue: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_QUEUED_PROGRESS)
    arrived = asyncio.Event()
    last: list[dict[str, Any]] = []

    def push(item: dict[str, Any]) -> None:
        queue.append(item)
        arrived.set()

    def emit(item: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(push, item)

    def finish(item: dict[str, Any]) -> None:
        last.append(item)
        arrived.set()

    async def run() -> None:
        try:
            outcome = {"result": await work(emit)}
        except Exception as exc:  # reported to the client as the last line
            outcome = error_body(exc)[1]
        loop.call_soon(finish, outcome)  # after every emit a worker thread already scheduled

    task = loop.create_task(run())

    async def lines() -> AsyncIterator[bytes]:
        _ = task  # keep a reference: the task must outlive a disconnected client
        while True:
            while queue:
                yield _line(queue.popleft())
            if last and not queue:
                yield _line(last[0])
                return
            arrived.clear()
            if not queue and not last:
                await arrived.wait()

    return NDJSONResponse(lines())


def attached(events: AsyncIterator[dict[str, Any]], finish: Callable[[], Awaitable[Any]]) -> NDJSONResponse:
    """Stream ``events`` as they come, then ``await finish()`` as the result line (or its error).

    Nothing is read ahead: a client that does not read holds the events where they are made. When
    the client disconnects the generator is closed, which closes ``events`` (and ends its call).
    """
    async def lines() -> AsyncIterator[bytes]:
        try:
            async for item in events:
                yield _line(item)
            yield _line({"result": await finish()})
        except Exception as exc:  # reported to the client as the last line
            yield _line(error_body(exc)[1])
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()

    return NDJSONResponse(lines())
