"""Bearer-token authentication for the daemon's TCP listener (the shared check of ``forkd.listeners``).

The Unix socket is guarded by its file mode (0600: only its owner connects); TCP has no such guard,
so the daemon listens on TCP only with a token, compared in constant time. ``/healthz`` stays open
so load balancers and probes need no secret.
"""

from __future__ import annotations

from forkd.listeners import ASGIApp, BearerAuth

OPEN_PATHS = frozenset({"/healthz"})


class TokenAuth(BearerAuth):
    """Every route but ``/healthz`` needs ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        super().__init__(app, token, "set FORKD_TOKEN to the daemon's token", OPEN_PATHS)
