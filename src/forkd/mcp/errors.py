"""Daemon errors as messages a model can act on: what went wrong, then what to do next.

Tools raise ``ToolError`` with this text, which the MCP SDK returns as an ``isError`` result; any
other exception would reach the model only as a bare "Error executing tool" line.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from mcp.server.mcpserver.exceptions import ToolError

from forkd.errors import KINDS, kind_for
from forkd.sdk.controller import ForkdError

_NO_ROUTE_STATUSES = (404, 405)
T = TypeVar("T")


def readable(exc: ForkdError) -> str:
    """The daemon's own message, plus the next step its kind (``forkd.errors``) names."""
    if exc.code in ("error", "no_route", "method_not_allowed") and exc.status in _NO_ROUTE_STATUSES:
        # A bare HTTP error, or the daemon saying it has no such route: it is older than this client.
        return (f"the forkd daemon does not offer this operation (HTTP {exc.status}); it is older than this "
                "forkd-mcp: upgrade forkd and restart the daemon")
    if exc.code not in KINDS:  # a client-side code (fork_failed, code_error): the message says it all
        return exc.message
    return f"{exc.message.rstrip('.')}. Next: {kind_for(exc).next_step}"


def tool_error(exc: ForkdError) -> ToolError:
    return ToolError(readable(exc))


async def answered(answer: Awaitable[T]) -> T:
    """A daemon call's answer; daemon errors become readable tool errors."""
    try:
        return await answer
    except ForkdError as exc:
        raise tool_error(exc) from None
