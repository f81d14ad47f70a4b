"""Request metrics: every answer counted by route template, method and status (errors included), and timed."""

from __future__ import annotations

import time
from typing import Any

from forkd.daemon.middleware import StatusSeen
from forkd.runtime.metrics import Metrics


class RequestMetrics:
    """Pure ASGI (no ``BaseHTTPMiddleware``), so streamed answers pass through untouched."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = StatusSeen(send)
        started = time.monotonic()
        try:
            await self.app(scope, receive, seen)
        finally:  # the router put the matched route into this scope
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.count_request(route, scope["method"], seen.status, time.monotonic() - started)
