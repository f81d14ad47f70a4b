"""The MCP tools that keep something open between calls: terminals (a shell or any program on a
guest PTY) and directory watchers, held by :class:`forkd.mcp.terminals.Holdings`.

Every call is bounded: a read waits at most ``MAX_WAIT_S`` and answers at most ``max_bytes`` of output
(the rest waits for the next read, and the program is paused while its buffer is full).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from forkd.mcp.errors import answered
from forkd.mcp.results import TerminalOutput, WatchEvents, WatchStarted
from forkd.mcp.terminals import Gone, Holdings, Terminal, TooMany

T = TypeVar("T")
MAX_WAIT_S = 60.0
MAX_OUTPUT_BYTES = 1 << 20
DEFAULT_SHELL = "command -v bash >/dev/null && exec bash || exec sh"
# CSI (colours, cursor moves, modes), OSC (titles) and two-character escapes: noise to a model.
ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")

SandboxId = Annotated[str, Field(description="sandbox id from spawn or list_sandboxes, e.g. sb-0123456789ab")]
TerminalId = Annotated[str, Field(min_length=1, max_length=64, description="terminal id from terminal_open")]
WatchId = Annotated[str, Field(min_length=1, max_length=64, description="watcher id from watch_start")]
Rows = Annotated[int, Field(ge=1, le=1000, description="terminal rows")]
Cols = Annotated[int, Field(ge=1, le=1000, description="terminal columns")]
Quiet = Annotated[float, Field(ge=0.05, le=10.0, description=(
    "once output came, return after this many seconds without more (ignored with 'until')"))]
Until = Annotated[str | None, Field(min_length=1, max_length=1000, description=(
    "return as soon as the output read contains this text (e.g. a prompt '$ '), else at wait_s"))]
MaxBytes = Annotated[int, Field(ge=256, le=MAX_OUTPUT_BYTES, description=(
    "answer at most this many bytes of output; the rest waits for terminal_read"))]
Raw = Annotated[bool, Field(description="keep escape sequences and CR LF as the program wrote them")]


async def _held(work: Awaitable[T]) -> T:
    """A holdings call: a daemon error, a missing id or a full table as a readable tool error."""
    try:
        return await answered(work)
    except (Gone, TooMany) as exc:
        raise ToolError(str(exc)) from None


def _lookup(holdings: Holdings, terminal_id: str) -> Terminal:
    try:
        return holdings.terminal(terminal_id)
    except Gone as exc:
        raise ToolError(str(exc)) from None


async def _output(terminal: Terminal, wait_s: float, quiet_s: float, until: str | None, max_bytes: int,
                  raw: bool) -> TerminalOutput:
    data = await terminal.read(wait_s, quiet_s, until.encode() if until else None, max_bytes)
    text = terminal.decoder.decode(data)
    if not raw:
        text = ESCAPES.sub("", text).replace("\r\n", "\n")
    exited = terminal.ended and not terminal.buffer
    result = terminal.result or {}
    return TerminalOutput(terminal_id=terminal.id, pid=terminal.pid, output=text, more=bool(terminal.buffer),
                          exited=exited, exit_code=result.get("exit_code") if exited else None,
                          signal=result.get("signal") if exited else None, error=terminal.error)


def add_interactive_tools(server: MCPServer, holdings: Holdings) -> None:
    """Register the terminal and watcher tools on ``server``."""

    @server.tool()
    async def terminal_open(
        sandbox_id: SandboxId,
        command: Annotated[str | None, Field(min_length=1, max_length=100_000, description=(
            "shell command line to run on the terminal (/bin/sh -c COMMAND); null: an interactive shell "
            "(bash if the guest has it)"))] = None,
        rows: Rows = 24,
        cols: Cols = 80,
        cwd: Annotated[str | None, Field(description="working directory (default /)")] = None,
        env: Annotated[dict[str, str] | None, Field(description=(
            "extra environment variables (TERM defaults to dumb: few escape sequences)"))] = None,
        wait_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S, description=(
            "seconds to wait for the program's first output (a prompt)"))] = 2.0,
    ) -> TerminalOutput:
        """Start a program on a pseudo-terminal in a sandbox and keep it open: an interactive shell by default.
        Type into it with terminal_send, read with terminal_read, end it with terminal_close. It stays open
        between calls (closed after 15 minutes without a call, or when forkd-mcp stops)."""
        argv = ["/bin/sh", "-c", command or DEFAULT_SHELL]
        terminal = await _held(holdings.open_terminal(sandbox_id, argv, rows, cols, {"TERM": "dumb", **(env or {})},
                                                      cwd))
        return await _output(terminal, wait_s, 0.3, None, 32_768, False)

    @server.tool()
    async def terminal_send(
        terminal_id: TerminalId,
        text: Annotated[str, Field(max_length=1 << 20, description=(
            "text typed at the terminal; control characters included (Ctrl+C is \\u0003, Ctrl+D \\u0004)"))],
        enter: Annotated[bool, Field(description="press Enter after the input (append a newline)")] = True,
        wait_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S, description="seconds to wait for output at most")] = 5.0,
        quiet_s: Quiet = 0.5,
        until: Until = None,
        max_bytes: MaxBytes = 32_768,
        raw: Raw = False,
    ) -> TerminalOutput:
        """Type input at an open terminal and return what the program writes back within a bounded wait."""
        terminal = _lookup(holdings, terminal_id)
        data = text + ("\n" if enter else "")
        await answered(holdings.controller.pty_input(terminal.sandbox_id, terminal.pid, data))
        return await _output(terminal, wait_s, quiet_s, until, max_bytes, raw)

    @server.tool()
    async def terminal_read(
        terminal_id: TerminalId,
        wait_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S, description=(
            "seconds to wait for output at most (0: only what is already there)"))] = 0.0,
        quiet_s: Quiet = 0.5,
        until: Until = None,
        max_bytes: MaxBytes = 32_768,
        raw: Raw = False,
    ) -> TerminalOutput:
        """Read what an open terminal's program wrote since the last read (e.g. a long command's progress)."""
        return await _output(_lookup(holdings, terminal_id), wait_s, quiet_s, until, max_bytes, raw)

    @server.tool()
    async def terminal_resize(terminal_id: TerminalId, rows: Rows, cols: Cols) -> dict[str, Any]:
        """Change an open terminal's size (its program gets SIGWINCH)."""
        terminal = _lookup(holdings, terminal_id)
        await answered(holdings.controller.pty_resize(terminal.sandbox_id, terminal.pid, rows, cols))
        return {"terminal_id": terminal_id, "rows": rows, "cols": cols}

    @server.tool()
    async def terminal_close(
        terminal_id: TerminalId,
        max_bytes: MaxBytes = 32_768,
    ) -> TerminalOutput:
        """Close a terminal: its program is hung up (SIGHUP, then SIGKILL); returns output not read yet."""
        terminal = _lookup(holdings, terminal_id)
        last = await _output(terminal, 0.0, 0.05, None, max_bytes, False)
        await _held(holdings.close_terminal(terminal_id))
        return last

    @server.tool()
    async def watch_start(
        sandbox_id: SandboxId,
        path: Annotated[str, Field(min_length=1, max_length=4096, description="a directory in the sandbox")],
        recursive: Annotated[bool, Field(description="also watch its subdirectories, present and future")] = False,
    ) -> WatchStarted:
        """Watch a directory in a sandbox for changes (created, written, removed, renamed, chmod'ed entries);
        read them with watch_events, end with watch_stop (closed after 15 minutes without a call)."""
        watcher = await _held(holdings.start_watch(sandbox_id, path, recursive))
        return WatchStarted(watch_id=watcher.id, sandbox_id=sandbox_id, path=path, recursive=recursive)

    @server.tool(name="watch_events")
    async def watch_events_tool(
        watch_id: WatchId,
        wait_s: Annotated[float, Field(ge=0, le=MAX_WAIT_S, description=(
            "seconds to wait for a first event at most (0: only what is already there)"))] = 5.0,
        max_events: Annotated[int, Field(ge=1, le=10_000, description=(
            "answer at most this many events; the rest wait for the next call"))] = 1000,
    ) -> WatchEvents:
        """The changes a watcher saw since the last call, waiting up to wait_s for a first one."""
        events, more = await _held(holdings.watch_events(watch_id, wait_s, max_events))
        return WatchEvents(watch_id=watch_id, events=events, more=more)

    @server.tool()
    async def watch_stop(watch_id: WatchId) -> dict[str, Any]:
        """Stop a directory watcher."""
        await _held(holdings.stop_watch(watch_id))
        return {"watch_id": watch_id, "stopped": True}
