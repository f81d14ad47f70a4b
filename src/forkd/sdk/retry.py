"""How long a client waits before asking a ``busy`` daemon again (503: over a concurrency cap, nothing done).

The daemon's ``Retry-After`` header says when, if it sent one; otherwise the pauses back off (0.5, 1, 2 s).
After the last pause the refusal is raised (``RateLimitException``). The TypeScript SDK does the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sandbox core uses busy_pauses and imports no HTTP client
    import httpx

BUSY_RETRIES = 3
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 30.0  # a Retry-After beyond this is not waited for in one call


def busy_pauses(retries: int = BUSY_RETRIES) -> Iterator[float | None]:
    """One item per attempt: the backoff pause before the next attempt, ``None`` for the last attempt."""
    for attempt in range(retries):
        yield FIRST_PAUSE_S * 2 ** attempt
    yield None


def is_busy(response: httpx.Response) -> bool:
    """A 503 whose error code is ``busy`` (a ``draining`` node is also 503 but retrying it does not help)."""
    if response.status_code != 503:
        return False
    try:
        return bool(response.json().get("error", {}).get("code") == "busy")
    except (ValueError, AttributeError):
        return False


def pause_for(response: httpx.Response, backoff_s: float) -> float:
    """The daemon's ``Retry-After`` (seconds, bounded by ``MAX_PAUSE_S``), else ``backoff_s``."""
    try:
        return min(max(float(response.headers["Retry-After"]), 0.0), MAX_PAUSE_S)
    except (KeyError, ValueError):
        return backoff_s


def resendable(content: object) -> bool:
    """Whether a request body can be sent again: a streamed upload (an iterator) cannot."""
    return content is None or isinstance(content, bytes | str)
