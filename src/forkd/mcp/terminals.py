"""Terminals and directory watchers an agent keeps between MCP tool calls.

MCP is request/answer while a terminal streams, so forkd-mcp holds each terminal's NDJSON stream
(``POST /v1/sandboxes/{id}/pty``, the session layer's PTY) open in a reader task of its own; what the
program writes waits in a bounded buffer until a tool call reads it. A full buffer stops the reader,
so the daemon's flow control pauses the program: nothing is dropped, nothing grows. A watcher is the
daemon's (``/watches``; its events wait in the guest, bounded there) and is read with bounded long polls.

Both belong to this process: closed by their tool, after ``idle_s`` without a call naming them, and
all at once when forkd-mcp stops (over stdio, when its client ends the session). A terminal whose
stream closes is hung up in the guest by the daemon (SIGHUP, then SIGKILL), so one left behind by a
forkd-mcp that died ends too. The MCP SDK tells a tool nothing of an HTTP session's end: there,
terminals and watchers a session left open end at the idle time.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeVar

from forkd.sdk.async_controller import AsyncController
from forkd.sdk.errors import ForkdError

BUFFER_BYTES = 1 << 20  # a terminal's unread output; past it the program is paused
MAX_TERMINALS = 16
MAX_WATCHERS = 64
IDLE_S = 900.0  # a terminal or watcher no call named for this long is closed
SWEEP_S = 30.0
WATCH_POLL_S = 10.0  # the daemon's longest long poll of a watcher
CLOSE_S = 10.0  # how long closing one may take before it is abandoned
log = logging.getLogger("forkd.mcp")


class Gone(LookupError):
    """No such terminal or watcher (never opened, closed, or closed for being idle)."""


class TooMany(RuntimeError):
    pass


@dataclass
class Terminal:
    """One program on a guest terminal, its output waiting here for the next read."""

    id: str
    sandbox_id: str
    pid: int = 0
    buffer: bytearray = field(default_factory=bytearray)
    ended: bool = False
    result: dict[str, Any] | None = None  # {exit_code, signal} once the program ended
    error: str | None = None  # why the stream broke, if it did
    used: float = field(default_factory=time.monotonic)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    reading: asyncio.Lock = field(default_factory=asyncio.Lock)  # one read at a time
    task: asyncio.Task[None] | None = None
    # UTF-8 split across two reads is decoded whole; bytes that are not UTF-8 become U+FFFD
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    async def pump(self, controller: AsyncController, argv: list[str], rows: int, cols: int, env: dict[str, str],
                   cwd: str | None, started: asyncio.Future[int]) -> None:
        """The reader task: the stream from start to end, every ``pty`` event into the buffer."""
        try:
            events = await controller.start_pty(self.sandbox_id, argv, rows=rows, cols=cols, env=env, cwd=cwd)
            async for event in events:
                if event.get("event") == "started":
                    self.pid = int(event["pid"])
                    started.set_result(self.pid)
                elif event.get("event") == "pty":
                    data = base64.b64decode(str(event.get("data_b64", "")))
                    async with self.changed:
                        await self.changed.wait_for(lambda: len(self.buffer) < BUFFER_BYTES)
                        self.buffer += data
                        self.changed.notify_all()
            self.result = events.result
        except ForkdError as exc:
            self.error = exc.message
            if not started.done():
                started.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - the terminal ends with its reason, forkd-mcp goes on
            self.error = f"the terminal's stream broke: {exc}"
            log.warning("terminal %s of %s: %s", self.id, self.sandbox_id, self.error)
        finally:
            if not started.done():
                started.set_exception(ForkdError(502, "error", "the terminal's stream ended before it started"))
            async with self.changed:
                self.ended = True
                self.changed.notify_all()

    async def read(self, wait_s: float, quiet_s: float, until: bytes | None, max_bytes: int) -> bytes:
        """What the program wrote, up to ``max_bytes``: waits up to ``wait_s`` for output, returning once
        ``until`` appeared (when given), else once output came and then none for ``quiet_s``, or it ended."""
        self.used = time.monotonic()
        deadline = self.used + wait_s
        got, last = bytearray(), 0.0
        async with self.reading, self.changed:
            while True:
                if self.buffer:
                    piece = self.buffer[: max_bytes - len(got)]
                    del self.buffer[: len(piece)]
                    got += piece
                    last = time.monotonic()
                    self.changed.notify_all()  # room for the reader task
                if len(got) >= max_bytes or (self.ended and not self.buffer) or (until and until in got):
                    break
                now = time.monotonic()
                timeout = deadline - now
                if got and not until:
                    timeout = min(timeout, last + quiet_s - now)
                if timeout <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout)
        self.used = time.monotonic()
        return bytes(got)

    async def close(self) -> None:
        """End the stream: the daemon hangs the program up."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self.task, CLOSE_S)


@dataclass
class Watcher:
    id: str
    sandbox_id: str
    daemon_id: str  # the daemon's id of the watcher in that sandbox
    pending: deque[dict[str, Any]] = field(default_factory=deque)  # read from the daemon, not yet answered
    used: float = field(default_factory=time.monotonic)


Held = TypeVar("Held", Terminal, Watcher)


def _named(table: dict[str, Held], key: str, missing: str) -> Held:
    """The one ``key`` names, marked as used now; ``Gone`` with ``missing`` when there is none."""
    held = table.get(key)
    if held is None:
        raise Gone(missing)
    held.used = time.monotonic()
    return held


class Holdings:
    """This forkd-mcp's terminals and watchers, by their ids; bounded in number, closed when idle."""

    def __init__(self, controller: AsyncController, idle_s: float = IDLE_S) -> None:
        self.controller = controller
        self.idle_s = idle_s
        self.terminals: dict[str, Terminal] = {}
        self.watchers: dict[str, Watcher] = {}
        self._sweeper: asyncio.Task[None] | None = None

    # terminals

    async def open_terminal(self, sandbox_id: str, argv: list[str], rows: int, cols: int, env: dict[str, str],
                            cwd: str | None) -> Terminal:
        if len(self.terminals) >= MAX_TERMINALS:
            raise TooMany(f"{MAX_TERMINALS} terminals are open: close one with terminal_close first")
        terminal = Terminal(id=f"t-{secrets.token_hex(6)}", sandbox_id=sandbox_id)
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        terminal.task = asyncio.create_task(terminal.pump(self.controller, argv, rows, cols, env, cwd, started),
                                            name=f"mcp-terminal-{terminal.id}")
        try:
            await started
        except BaseException:
            await terminal.close()
            raise
        self.terminals[terminal.id] = terminal
        self._sweep_later()
        return terminal

    def terminal(self, terminal_id: str) -> Terminal:
        return _named(self.terminals, terminal_id, f"no terminal {terminal_id!r}: it was closed (terminal_close, or "
                      f"after {self.idle_s:.0f} s without a call); open one with terminal_open")

    async def close_terminal(self, terminal_id: str) -> Terminal:
        terminal = self.terminal(terminal_id)
        del self.terminals[terminal_id]
        await terminal.close()
        return terminal

    # watchers

    async def start_watch(self, sandbox_id: str, path: str, recursive: bool) -> Watcher:
        if len(self.watchers) >= MAX_WATCHERS:
            raise TooMany(f"{MAX_WATCHERS} watchers are open: stop one with watch_stop first")
        daemon_id = await self.controller.watch(sandbox_id, path, recursive)
        watcher = Watcher(id=f"w-{secrets.token_hex(6)}", sandbox_id=sandbox_id, daemon_id=daemon_id)
        self.watchers[watcher.id] = watcher
        self._sweep_later()
        return watcher

    def watcher(self, watch_id: str) -> Watcher:
        return _named(self.watchers, watch_id, f"no watcher {watch_id!r}: it was stopped (watch_stop, or after "
                      f"{self.idle_s:.0f} s without a call); start one with watch_start")

    async def watch_events(self, watch_id: str, wait_s: float, max_events: int) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``max_events`` events, waiting up to ``wait_s`` for a first one (in long polls of at most
        ``WATCH_POLL_S``); and whether more are already waiting."""
        watcher = self.watcher(watch_id)
        deadline = time.monotonic() + wait_s
        while not watcher.pending:
            poll = max(0.0, min(WATCH_POLL_S, deadline - time.monotonic()))
            watcher.pending.extend(await self.controller.watch_events(watcher.sandbox_id, watcher.daemon_id, poll))
            if poll == 0.0:
                break
        taken = [watcher.pending.popleft() for _ in range(min(max_events, len(watcher.pending)))]
        watcher.used = time.monotonic()
        return taken, bool(watcher.pending)

    async def stop_watch(self, watch_id: str) -> None:
        watcher = self.watcher(watch_id)
        del self.watchers[watch_id]
        await self._unwatch(watcher)

    async def _unwatch(self, watcher: Watcher) -> None:
        try:
            await asyncio.wait_for(self.controller.unwatch(watcher.sandbox_id, watcher.daemon_id), CLOSE_S)
        except (ForkdError, TimeoutError) as exc:  # its sandbox ended: the watcher ended with it
            log.info("watcher %s of %s: %s", watcher.id, watcher.sandbox_id, exc)

    # closing

    async def sweep(self, now: float | None = None) -> list[str]:
        """Close what no call named for ``idle_s``; their ids."""
        now = time.monotonic() if now is None else now
        idle_terminals = [t for t in self.terminals.values() if now - t.used >= self.idle_s]
        idle_watchers = [w for w in self.watchers.values() if now - w.used >= self.idle_s]
        for terminal in idle_terminals:
            self.terminals.pop(terminal.id, None)
            await terminal.close()
        for watcher in idle_watchers:
            self.watchers.pop(watcher.id, None)
            await self._unwatch(watcher)
        return [t.id for t in idle_terminals] + [w.id for w in idle_watchers]

    def _sweep_later(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweeping(), name="mcp-idle-sweep")

    async def _sweeping(self) -> None:
        while self.terminals or self.watchers:
            await asyncio.sleep(min(SWEEP_S, self.idle_s))
            await self.sweep()

    async def close(self) -> None:
        """Close every terminal and watcher (forkd-mcp is stopping)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        terminals, watchers = list(self.terminals.values()), list(self.watchers.values())
        self.terminals.clear()
        self.watchers.clear()
        await asyncio.gather(*(t.close() for t in terminals), *(self._unwatch(w) for w in watchers))
