"""Daemon errors as messages a model can act on: what went wrong, then what to do next.

Tools raise ``ToolError`` with this text, which the MCP SDK returns as an ``isError`` result; any
other exception would reach the model only as a bare "Error executing tool" line.
"""

from __future__ import annotations

from mcp.server.mcpserver.exceptions import ToolError

from forkd.sdk.controller import ForkdError

_NEXT_STEP = {
    "unreachable": "start it with `forkd daemon` as root, or point FORKD_URL at a running daemon",
    "agent_unavailable": "the sandbox's guest agent is gone: kill the sandbox and spawn a new one",
    "timeout": "raise timeout_s, or split the work into shorter calls",
    "snapshot_mismatch": "recreate the snapshot with create_snapshot (it was saved by another VMM setup)",
    "snapshot_corrupt": "remove the snapshot with `forkd rmi TAG` and recreate it with create_snapshot",
    "conflict": "pick another tag, or wait for the operation holding it to finish",
}
_NO_ROUTE_STATUSES = (404, 405)


def readable(exc: ForkdError) -> str:
    """The daemon's own message, plus the next step when one is known."""
    if exc.code == "error" and exc.status in _NO_ROUTE_STATUSES:
        # A forkd error always has a code; a bare HTTP error means the route does not exist.
        return (f"the forkd daemon does not offer this operation (HTTP {exc.status}); it is older than this "
                "forkd-mcp: upgrade forkd and restart the daemon")
    step = _NEXT_STEP.get(exc.code)
    return f"{exc.message.rstrip('.')}. Next: {step}" if step else exc.message


def tool_error(exc: ForkdError) -> ToolError:
    return ToolError(readable(exc))
