"""``forkd.Controller``: the REST client every front end (CLI, SDK, MCP) uses to reach the daemon.

Which daemon and how is a ``ConnectionConfig`` (``FORKD_URL``, ``FORKD_TOKEN``, ``FORKD_CA_CERT``); the
operations themselves (paths, bodies, answers) are ``operations.Operations``, shared with ``AsyncController``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import httpx

from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.errors import DaemonUnreachable, ForkdError
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

__all__ = ["Controller", "DaemonUnreachable", "EventStream", "ForkdError"]


class EventStream(StreamState):
    """An NDJSON answer being read: iterate its events; ``result`` is set once the last line came.

    Kept open across calls so a background command's events can be read long after it started.
    """

    def __init__(self, context: Any, url: str) -> None:
        self._context = context
        self._url = url
        try:
            self._response: httpx.Response = context.__enter__()
            if not self._response.is_success:
                self._response.read()
                raise_for(self._response)
        except httpx.TransportError as exc:
            self.close()
            raise DaemonUnreachable(url, str(exc) or type(exc).__name__) from None
        except BaseException:
            self.close()
            raise
        super().__init__()
        self._lines = self._response.iter_lines()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for text in self._lines:
                if (event := self.take(text)) is not None:
                    yield event
                elif self.done:
                    return
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self._url, str(exc) or type(exc).__name__) from None
        finally:
            self.close()
        raise truncated()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._context.__exit__(None, None, None)


class Controller(Operations):
    """Synchronous client for the forkd REST API (every operation: see ``Operations``)."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float | None = None, *,
                 connection: ConnectionConfig | None = None, http: httpx.Client | None = None) -> None:
        """Talk to ``connection`` (default: the environment's daemon, see ``ConnectionConfig.from_env``);
        ``url``/``token``/``timeout`` override it. ``http`` is a ready client to send through instead."""
        self.connection = ConnectionConfig.resolve(connection, url, token)
        if timeout is not None:
            self.connection = dataclasses.replace(self.connection, request_timeout=timeout)
        self.url = self.connection.url
        self._http = http or self.connection.client()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request and answer its JSON (for calls ``Operations`` does not name)."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None
        raise_for(response)
        return response.json()

    def _send(self, call: Call) -> Any:
        return call.parse(self.request(call.method, call.path, **call.options()))

    def _open_stream(self, call: Call) -> EventStream:
        return EventStream(self._http.stream(call.method, call.path, **call.options()), self.url)

    def _stream(self, call: Call, on_line: Callable[[dict[str, Any]], Any] | None) -> Any:
        events = self._open_stream(call)
        for line in events:
            if on_line is not None:
                on_line(line)
        return events.result

    def fork_iter(self, tag: str, n: int = 1, **options: Any) -> Iterator[dict[str, Any]]:
        """Fork like :meth:`fork`, yielding each child as it answers or fails, in that order:
        ``{"index": i, "sandbox": {...}, "timings": {...}}`` or ``{"index": i, "error": "...", ...}``."""
        for line in self._open_stream(fork_call(tag, n, options).streamed()):
            if "child" in line:
                yield line["child"]

    def read_file(self, sandbox_id: str, path: str, max_bytes: int | None = None) -> bytes:
        """The whole file; with ``max_bytes``, refused (413 ``too_large``) as soon as it holds more."""
        data = bytearray()
        chunks = self.read_file_chunks(sandbox_id, path)
        try:
            for chunk in chunks:
                append_bounded(data, chunk, max_bytes, path)
        finally:
            chunks.close()  # stops the download where it is
        return bytes(data)

    def read_file_chunks(self, sandbox_id: str, path: str) -> Generator[bytes, None, None]:
        """The file's bytes as they arrive (a large file is never held whole)."""
        call = read_file_call(sandbox_id, path)
        try:
            with self._http.stream(call.method, call.path, **call.options()) as response:
                if not response.is_success:
                    response.read()
                    raise_for(response)
                yield from response.iter_bytes()
        except httpx.TransportError as exc:
            raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None

    def wait_snapshot(self, tag: str, timeout_s: float = 600.0, poll_s: float = 0.2) -> dict[str, Any]:
        """Poll until snapshot ``tag`` is no longer ``writing``; returns it (``ready`` or ``failed``)."""
        deadline = time.monotonic() + timeout_s
        while (info := self.snapshot(tag))["status"] == "writing":
            if time.monotonic() > deadline:
                raise ForkdError(504, "timeout", f"snapshot {tag!r} still writing after {timeout_s:.0f} s")
            time.sleep(poll_s)
        return info
