"""ASGI middleware around the API, outermost first: audit log, bearer token (TCP), body limit, request metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]


class StatusSeen:
    """Wraps ``send`` to note the answer's status (500 until a response starts: what a crash answers)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 500

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)
