"""The REST calls for what stays open in a sandbox across requests: directory watchers and terminals.

Mixed into ``Controller`` and ``AsyncController`` beside ``Operations`` (which supplies the transport):
the calls are the same for both, each answering a value or an awaitable, as ``Operations``' do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from forkd.sdk.operations import LONG_TIMEOUT_S, Call

WATCH_POLL_GRACE_S = 60.0  # a watch's long poll may take this much longer than its wait_s


class LiveOperations:
    _send: Callable[[Call], Any]
    _open_stream: Callable[[Call], Any]

    # directory watchers

    def create_watch(self, sandbox_id: str, path: str, recursive: bool = False) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/watches",
                               json={"path": path, "recursive": recursive}, key="id"))

    def watch_events(self, sandbox_id: str, watch_id: str, wait_s: float = 0.0) -> Any:
        return self._send(Call("GET", f"/v1/sandboxes/{sandbox_id}/watches/{watch_id}/events",
                               params={"wait_s": wait_s}, timeout=wait_s + WATCH_POLL_GRACE_S, key="events"))

    def remove_watch(self, sandbox_id: str, watch_id: str) -> Any:
        return self._send(Call("DELETE", f"/v1/sandboxes/{sandbox_id}/watches/{watch_id}", void=True))

    # terminals

    def start_pty(self, sandbox_id: str, argv: list[str], *, env: dict[str, str] | None = None,
                  cwd: str | None = None, rows: int = 24, cols: int = 80) -> Any:
        """Start ``argv`` on a pseudo-terminal and answer its open event stream (``started`` first, then
        ``pty`` events with ``data_b64``); closing the stream hangs the terminal up."""
        body: dict[str, Any] = {"argv": argv, "env": env or {}, "rows": rows, "cols": cols}
        if cwd is not None:
            body["cwd"] = cwd
        return self._open_stream(Call("POST", f"/v1/sandboxes/{sandbox_id}/pty", json=body, timeout=LONG_TIMEOUT_S))

    def pty_input(self, sandbox_id: str, pid: int, data: str) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/pty/{pid}/input", json={"data": data}, void=True))

    def pty_resize(self, sandbox_id: str, pid: int, rows: int, cols: int) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/pty/{pid}/resize",
                               json={"rows": rows, "cols": cols}, void=True))

    def pty_signal(self, sandbox_id: str, pid: int, signal: int = 9) -> Any:
        return self._send(Call("POST", f"/v1/sandboxes/{sandbox_id}/pty/{pid}/signal", json={"signal": signal},
                               void=True))
