"""Exceptions every forkd client raises, named after E2B's where the meaning is the same.

The daemon answers errors as ``{"error": {"code", "message"}}`` with an HTTP status; the status
picks the class, so callers can catch ``NotFoundException`` without parsing messages.
"""

from __future__ import annotations


class ForkdError(RuntimeError):
    """The daemon refused or failed a request; ``status`` and ``code`` say how."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


SandboxException = ForkdError  # E2B's name for the base class


class DaemonUnreachable(ForkdError):
    def __init__(self, where: str, reason: str) -> None:
        super().__init__(0, "unreachable", f"cannot reach the forkd daemon at {where}: {reason} "
                                           "(start it with `forkd daemon`, or set FORKD_URL)")


class InvalidArgumentException(ForkdError):
    """400/422: the request itself is wrong; its message names the field."""


class AuthenticationException(ForkdError):
    """401: no bearer token, or the wrong one (set FORKD_TOKEN)."""


class NotFoundException(ForkdError):
    """404: no such sandbox, snapshot, file or process."""


class ConflictException(ForkdError):
    """409: the target is busy or in the wrong state (e.g. a snapshot still being written)."""


class TimeoutException(ForkdError):
    """504 or a command that ran past its timeout."""


class RateLimitException(ForkdError):
    """503/429: over a concurrency cap; retry later."""


_BY_STATUS: dict[int, type[ForkdError]] = {
    400: InvalidArgumentException, 401: AuthenticationException, 404: NotFoundException, 409: ConflictException,
    413: InvalidArgumentException, 422: InvalidArgumentException, 429: RateLimitException,
    503: RateLimitException, 504: TimeoutException,
}


def error_for(status: int, code: str, message: str) -> ForkdError:
    return _BY_STATUS.get(status, ForkdError)(status, code, message)
