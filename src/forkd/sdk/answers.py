"""How the daemon's answers are read, by both clients: error bodies as the SDK's exceptions, NDJSON lines as
events, results or raised errors, and a transport failure as ``DaemonUnreachable``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx

from forkd.errors import KINDS, kind_of
from forkd.sdk.errors import DaemonUnreachable, ForkdError, error_for


def raise_for(response: httpx.Response) -> None:
    """Raise the SDK exception for an error answer (its body must have been read)."""
    if response.is_success:
        return
    try:
        err = response.json().get("error", {})
        code, message = err.get("code", "error"), err.get("message", response.text)
    except (ValueError, AttributeError):
        err, code, message = {}, "error", response.text
    raise error_for(response.status_code, code, message, _details(err))


def _details(err: dict[str, Any]) -> dict[str, Any]:
    """An error body's fields beyond code and message (the guest's ``errno``, a retry hint)."""
    return {key: value for key, value in err.items() if key not in ("code", "message")}


def decode_line(text: str) -> tuple[str, Any]:
    """One NDJSON line: ``("event", line)``, ``("result", value)`` or ``("skip", None)``; raises an error line."""
    if not text.strip():
        return "skip", None
    line = json.loads(text)
    if "error" in line:
        err = line["error"]
        code = str(err.get("code", "error"))
        raise error_for(kind_of(code).status, code, err.get("message", ""), _details(err))
    if "result" in line:
        return "result", line["result"]
    return "event", line


class StreamState:
    """What an NDJSON answer has said so far: ``result`` once its last line came (then ``done``)."""

    def __init__(self) -> None:
        self.result: Any = None
        self.done = False

    def take(self, text: str) -> dict[str, Any] | None:
        """The event on this line; None for a blank line or the result line."""
        kind, value = decode_line(text)
        if kind == "result":
            self.done, self.result = True, value
        return value if kind == "event" else None


def truncated() -> ForkdError:
    return ForkdError(500, "truncated", f"the daemon closed the stream without a result; "
                                        f"{KINDS['truncated'].next_step}")



@contextlib.contextmanager
def reaching(url: str) -> Iterator[None]:
    """A transport failure talking to the daemon at ``url`` raised as ``DaemonUnreachable``."""
    try:
        yield
    except httpx.TransportError as exc:
        raise DaemonUnreachable(url, str(exc) or type(exc).__name__) from None
