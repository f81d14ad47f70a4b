"""Exceptions every forkd client raises, named after E2B's where the meaning is the same.

The daemon answers errors as ``{"error": {"code", "message"}}`` with an HTTP status; the code's
kind in ``forkd.errors`` picks the class, so callers can catch ``NotFoundException`` without parsing
messages.
"""

from __future__ import annotations

from typing import Any

from forkd.errors import KINDS, kind_for_status


class ForkdError(RuntimeError):
    """The daemon refused or failed a request; ``status`` and ``code`` say how, ``details`` holds the error body's
    other fields (e.g. the guest's ``errno`` when a command could not start)."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}

    @property
    def kind(self) -> str:
        """The daemon's code is the error's kind (``forkd.errors.kind_for`` reads it); client-side codes such
        as ``fork_failed`` or ``command_exit`` are not in the table and count as internal there."""
        return self.code

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt as itself, with its fields, across a pickle (a Ray task, a process pool), whatever its
        subclass's ``__init__`` takes: ``DaemonUnreachable``'s differs."""
        return _rebuild, (type(self), self.status, self.code, self.message), dict(self.__dict__)


def _rebuild(cls: type[ForkdError], status: int, code: str, message: str) -> ForkdError:
    error = cls.__new__(cls)
    ForkdError.__init__(error, status, code, message)
    return error


SandboxException = ForkdError  # E2B's name for the base class


class DaemonUnreachable(ForkdError):
    def __init__(self, where: str, reason: str) -> None:
        super().__init__(0, "unreachable", f"cannot reach the forkd daemon at {where}: {reason} "
                                           f"({KINDS['unreachable'].next_step})")


class InvalidArgumentException(ForkdError):
    """400/413: the request itself is wrong; its message names the field."""


class AuthenticationException(ForkdError):
    """401: no bearer token, or the wrong one (set FORKD_TOKEN)."""


class NotFoundException(ForkdError):
    """404: no such sandbox, snapshot, file or process."""


class ConflictException(ForkdError):
    """409: the target is busy or in the wrong state (e.g. a snapshot still being written)."""


class TimeoutException(ForkdError):
    """504 or a command that ran past its timeout."""


class RateLimitException(ForkdError):
    """503: over a concurrency cap; retry later."""


_BY_FAMILY: dict[str, type[ForkdError]] = {
    "invalid_argument": InvalidArgumentException, "authentication": AuthenticationException,
    "not_found": NotFoundException, "conflict": ConflictException, "timeout": TimeoutException,
    "rate_limit": RateLimitException,
}


def error_for(status: int, code: str, message: str, details: dict[str, object] | None = None) -> ForkdError:
    """The exception for an error answer: by its code's kind, or by its status when the code is not forkd's."""
    kind = KINDS.get(code) or kind_for_status(status)
    return _BY_FAMILY.get(kind.family, ForkdError)(status, code, message, details)
