"""``forkd.Controller``: the REST client every front end (CLI, SDK, MCP) uses to reach the daemon.

Which daemon and how is a ``ConnectionConfig`` (``FORKD_URL``, ``FORKD_TOKEN``, ``FORKD_CA_CERT``); the
operations themselves (paths, bodies, answers) are ``operations.Operations``, shared with ``AsyncController``.
This module only moves bytes on ``httpx.Client``, and defines the sync flavour (``SYNC``) that runs the
steps of ``Operations`` and of the sandbox core straight through.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator
from typing import IO, Any, TypeVar

import httpx

from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.errors import DaemonUnreachable, ForkdError
from forkd.sdk.answers import StreamState, raise_for, reaching, truncated
from forkd.sdk.calls import Call, fork_call, read_file_call
from forkd.sdk.operations import Operations
from forkd.sdk.records import SnapshotRecord
from forkd.sdk.retry import busy_pauses, is_busy, pause_for, resendable
from forkd.sdk.sandbox.flavour import UPLOAD_PIECE_BYTES, Flavour, Steps, SyncSide, upload_piece

__all__ = ["SYNC", "Controller", "DaemonUnreachable", "EventStream", "ForkdError"]

T = TypeVar("T")


def run(steps: Steps[Any]) -> Any:
    """Each yielded value is already the answer: send it straight back."""
    try:
        answer = next(steps)
        while True:
            answer = steps.send(answer)
    except StopIteration as done:
        return done.value


def _pieces(file: IO[Any]) -> Iterator[bytes]:
    while piece := file.read(UPLOAD_PIECE_BYTES):
        yield upload_piece(piece)


SYNC = Flavour(run=run, iterate=iter, next=lambda iterator: next(iterator, None), collect=list,
               close=lambda iterator: iterator.close(), pieces=_pieces, sleep=time.sleep)


class EventStream(StreamState):
    """An NDJSON answer being read: iterate its events; ``result`` is set once the last line came.

    Kept open across calls so a background command's events can be read long after it started.
    """

    def __init__(self, context: Any, url: str) -> None:
        self._context = context
        self._url = url
        try:
            with reaching(url):
                self._response: httpx.Response = context.__enter__()
            if not self._response.is_success:
                self._response.read()
                raise_for(self._response)
        except BaseException:
            self.close()
            raise
        super().__init__()
        self._lines = self._response.iter_lines()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            with reaching(self._url):
                for text in self._lines:
                    if (event := self.take(text)) is not None:
                        yield event
                    elif self.done:
                        return
        finally:
            self.close()
        raise truncated()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._context.__exit__(None, None, None)


class Controller(Operations, SyncSide):
    """Synchronous client for the forkd REST API (every operation: see ``Operations``)."""

    _flavour = SYNC
    _new_client = staticmethod(ConnectionConfig.client)

    def close(self) -> None:
        """Close the HTTP connection (sandboxes keep running)."""
        self._http.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request and answer its JSON (for calls ``Operations`` does not name); a ``busy`` refusal
        is sent again after the daemon's ``Retry-After`` or a backoff (``retry.py``), unless the body streams."""
        for pause in busy_pauses():
            with reaching(self.url):
                response = self._http.request(method, path, **kwargs)
            if pause is None or not is_busy(response) or not resendable(kwargs.get("content")):
                break
            time.sleep(pause_for(response, pause))
        raise_for(response)
        return response.json()

    def _send(self, call: Call[T]) -> T:
        return call.parse(self.request(call.method, call.path, **call.options()))

    def _open_stream(self, call: Call[Any]) -> EventStream:
        return EventStream(self._http.stream(call.method, call.path, **call.options()), self.url)

    def _stream(self, call: Call[Any], on_line: Callable[[dict[str, Any]], Any] | None) -> Any:
        events = self._open_stream(call)
        for line in events:
            if on_line is not None:
                on_line(line)
        return events.result

    def fork_iter(self, tag: str, n: int = 1, **options: Any) -> Iterator[dict[str, Any]]:
        """Fork like :meth:`fork`, yielding each child as it answers or fails, in that order:
        ``{"index": i, "sandbox": {...}, "timings": {...}}`` or ``{"index": i, "error": {code, message}, ...}``."""
        for line in self._open_stream(fork_call(tag, n, options).streamed()):
            if "child" in line:
                yield line["child"]

    def read_file_chunks(self, sandbox_id: str, path: str) -> Generator[bytes, None, None]:
        """The file's bytes as they arrive (a large file is never held whole)."""
        call = read_file_call(sandbox_id, path)
        with reaching(self.url), self._http.stream(call.method, call.path, **call.options()) as response:
            if not response.is_success:
                response.read()
                raise_for(response)
            yield from response.iter_bytes()

    def wait_snapshot(self, tag: str, timeout_s: float = 600.0, poll_s: float = 0.2) -> SnapshotRecord:
        """Poll until snapshot ``tag`` is no longer ``writing``; returns it (``ready`` or ``failed``)."""
        deadline = time.monotonic() + timeout_s
        while (info := self.snapshot(tag))["status"] == "writing":
            if time.monotonic() > deadline:
                raise ForkdError(504, "timeout", f"snapshot {tag!r} still writing after {timeout_s:.0f} s")
            time.sleep(poll_s)
        return info
