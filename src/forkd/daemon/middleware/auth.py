"""Bearer-token authentication for the daemon's TCP listener.

The Unix socket is guarded by its file mode (0600: only its owner connects); TCP has no such guard,
so the daemon listens on TCP only with a token, compared in constant time. ``/healthz`` stays open
so load balancers and probes need no secret.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
                   Awaitable[None]]

MIN_TOKEN_CHARS = 32
OPEN_PATHS = frozenset({"/healthz"})
_PLACEHOLDERS = ("changeme", "change-me", "change_me", "token", "secret", "password", "example", "your",
                 "placeholder", "default", "forkd", "xxxx", "test", "1234")


class TokenRejected(ValueError):
    pass


def check_token(token: str | None) -> str:
    """The token, stripped, if it is fit to guard a network listener; else a reason to pick another."""
    token = (token or "").strip()
    hint = "generate one with `openssl rand -hex 32` (or `python3 -c 'import secrets; print(secrets.token_hex(32))'`)"
    if not token:
        raise TokenRejected(f"listening on TCP needs a bearer token: {hint}")
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenRejected(f"the token has {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed: {hint}")
    lowered = token.lower()
    if any(word in lowered for word in _PLACEHOLDERS) or len(set(token)) < 10:
        raise TokenRejected(f"the token looks like a placeholder or has too few distinct characters: {hint}")
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        raise TokenRejected("the token may not contain whitespace or control characters")
    return token


class TokenAuth:
    """ASGI middleware: every route but ``/healthz`` needs ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {check_token(token)}".encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"code": "unauthorized",
                                     "message": "missing or wrong bearer token: set FORKD_TOKEN to the daemon's token"}})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body.encode()})

    def _authorized(self, scope: Scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)
