"""Request body limits: answer 413 before reading more than a route may take.

File uploads stream to the guest in chunks, so they get a large limit; every other body is JSON
validated by pydantic and small. Both the declared ``Content-Length`` and the bytes actually
received are checked (a chunked body has no length).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_BODY_BYTES = 32 << 20
MAX_UPLOAD_BYTES = 64 << 30
_UPLOAD_PATH = re.compile(r"^/v1/sandboxes/[^/]+/files$")


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: Any, max_json_bytes: int = MAX_JSON_BODY_BYTES,
                 max_upload_bytes: int = MAX_UPLOAD_BYTES) -> None:
        self.app = app
        self.max_json_bytes = max_json_bytes
        self.max_upload_bytes = max_upload_bytes

    def limit_for(self, scope: dict[str, Any]) -> int:
        is_upload = scope["method"] == "PUT" and _UPLOAD_PATH.match(scope["path"])
        return self.max_upload_bytes if is_upload else self.max_json_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(send, limit)
            return
        received = 0
        started = False

        async def counting_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _too_large(send, limit)


async def _too_large(send: Any, limit: int) -> None:
    body = json.dumps({"error": {"code": "body_too_large",
                                 "message": f"request body over the {limit}-byte limit of this route"}})
    await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body.encode()})
