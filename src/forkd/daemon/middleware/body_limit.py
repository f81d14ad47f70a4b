"""Request body limits: answer 413 before reading more than a route may take, and (where asked)
408 to a body that stalls.

File uploads stream to the guest in chunks, so they get a large limit; every other body is JSON
validated by pydantic and small. Both the declared ``Content-Length`` and the bytes actually
received are checked (a chunked body has no length). With ``body_timeout_s``, a client that
starts a body and then sends nothing for that long is refused and its connection closed: the head
deadline (daemon/server.py) bounds a slow head, this bounds a slow body. Only the wait for the
client's next chunk counts, never the app's own pace; bodies that are streams by design (a
client-streaming RPC carrying typed input) are exempt.

The refusal is raised inside the app's ``receive``; an app that catches it and answers something
else (a handler turning any exception into a 500) has that answer replaced by the refusal, as
long as nothing was sent yet.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

MAX_JSON_BODY_BYTES = 32 << 20
MAX_UPLOAD_BYTES = 64 << 30
_UPLOAD_PATH = re.compile(r"^/v1/sandboxes/[^/]+/files$")

Scope = dict[str, Any]
# (status, code, message) → the JSON body of a refusal, in the shape the listener's clients expect
Shape = Callable[[int, str, str], dict[str, Any]]


class BodyTooLarge(Exception):
    pass


class BodyTooSlow(Exception):
    pass


def rest_upload(scope: Scope) -> bool:
    return scope["method"] == "PUT" and bool(_UPLOAD_PATH.match(scope["path"]))


def rest_shape(_: int, code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


class BodyLimit:
    def __init__(self, app: Any, max_json_bytes: int = MAX_JSON_BODY_BYTES,
                 max_upload_bytes: int = MAX_UPLOAD_BYTES, is_upload: Callable[[Scope], bool] = rest_upload,
                 body_timeout_s: float | None = None, is_stream: Callable[[Scope], bool] = lambda _: False,
                 shape: Shape = rest_shape) -> None:
        self.app = app
        self.max_json_bytes = max_json_bytes
        self.max_upload_bytes = max_upload_bytes
        self.is_upload = is_upload
        self.body_timeout_s = body_timeout_s
        self.is_stream = is_stream
        self.shape = shape

    def limit_for(self, scope: Scope) -> int:
        """Uploads and streamed bodies (each message of which is bounded on its own) get the large limit."""
        return self.max_upload_bytes if self.is_upload(scope) or self.is_stream(scope) else self.max_json_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        too_large = (413, "body_too_large", f"request body over the {limit}-byte limit of this route")
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, too_large)
            return
        deadline = None if self.is_stream(scope) else self.body_timeout_s
        received, body_done, started, replaced = 0, False, False, False
        refusal: tuple[int, str, str] | None = None

        async def counting_receive() -> dict[str, Any]:
            nonlocal received, body_done, refusal
            if body_done or deadline is None:
                message = await receive()  # after the body: waiting for a disconnect, unbounded
            else:
                try:
                    message = await asyncio.wait_for(receive(), deadline)
                except asyncio.TimeoutError:
                    refusal = (408, "body_too_slow", f"the request body sent nothing for {deadline:g} s; "
                                                     "send it without pauses")
                    raise BodyTooSlow from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    refusal = too_large
                    raise BodyTooLarge
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started, replaced
            if replaced:
                return  # the rest of an answer the refusal replaced
            if message["type"] == "http.response.start":
                if refusal is not None and message["status"] != refusal[0]:
                    started = replaced = True  # the app answered a refused body its own way
                    await self._refuse(send, refusal)
                    return
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except (BodyTooLarge, BodyTooSlow):
            if not started and refusal is not None:
                await self._refuse(send, refusal)

    async def _refuse(self, send: Any, refusal: tuple[int, str, str]) -> None:
        status, code, message = refusal
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": json.dumps(self.shape(status, code, message)).encode()})
