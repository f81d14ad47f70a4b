"""E2B's error shapes, and how forkd's runtime errors translate into them.

Three shapes, one per kind of traffic: the control plane and envd's HTTP routes answer
``{"code": <http status>, "message": ...}``; Connect RPCs answer ``{"code": "<connect code>",
"message": ...}`` with the status Connect assigns that code (or, inside a stream, the same object
in the end-of-stream frame). A sandbox that is gone is answered the way E2B's proxy does: a 502
whose message says it "was not found", which the SDKs turn into their not-running error. A runtime
error is translated by the kind it carries (``forkd.errors.kind_for``), as the daemon's own API does.
"""

from __future__ import annotations

from typing import Any

from forkd.errors import ErrorKind, kind_for, message_for
from forkd.runtime.agent_client import AgentError, AgentUnavailable
from forkd.runtime.sandboxes import SandboxEnded
from forkd.runtime.spawning import Draining
from forkd.store.errors import DiskFull, SnapshotError
from forkd.validation import ValidationError
from forkd.vmm.base import VmmError

# Connect code → HTTP status, from the Connect protocol specification.
CONNECT_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}
_ERRNO_CODES = {"EEXIST": "already_exists", "EACCES": "permission_denied", "EPERM": "permission_denied",
                "ENOTDIR": "invalid_argument", "EISDIR": "invalid_argument", "ENOTEMPTY": "failed_precondition",
                "ENOSPC": "resource_exhausted"}
# forkd's kinds (``forkd.errors``) as Connect codes; any other kind is "internal".
_CONNECT_CODES = {"not_found": "not_found", "invalid_request": "invalid_argument", "bad_request": "invalid_argument",
                  "timeout": "deadline_exceeded", "unknown_op": "unimplemented", "agent_unavailable": "unavailable",
                  "disk_full": "resource_exhausted"}


class E2BError(Exception):
    """An answer in E2B's HTTP error shape: ``{"code": status, "message": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"code": self.status, "message": self.message}


class ConnectError(Exception):
    """A Connect RPC error: a code from the Connect protocol and a message for the user."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def status(self) -> int:
        return CONNECT_STATUS.get(self.code, 500)

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}


def sandbox_gone(sandbox_id: str, why: str = "") -> E2BError:
    """What E2B's proxy answers for a sandbox it cannot route to; the SDKs key on "was not found"."""
    return E2BError(502, f"The sandbox {sandbox_id} was not found{': ' + why if why else ''}")


def to_connect(exc: BaseException) -> ConnectError:
    """The Connect error for an exception raised while serving an RPC."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, E2BError):
        return ConnectError("unavailable" if exc.status == 502 else "invalid_argument", exc.message)
    if isinstance(exc, AgentUnavailable):
        return ConnectError("unavailable", f"the sandbox's agent cannot be reached: {exc.message}")
    kind = kind_for(exc)
    errno_code = _ERRNO_CODES.get(str(exc.details.get("errno")), "") if isinstance(exc, AgentError) else ""
    return ConnectError(errno_code or _CONNECT_CODES.get(kind.code, "internal"), message_for(exc))


# Kinds of runtime failures of lifecycle calls (create, fork, pause): the kind's status is E2B's code.
_LIFECYCLE_KINDS = frozenset({"sandbox_ended", "snapshot_mismatch", "snapshot_corrupt", "conflict", "busy",
                              "draining", "snapshot_error", "disk_full", "vmm_error", "isolation_error"})
#: What the control plane answers in E2B's shape rather than as an unexpected failure.
CONTROL_ERRORS = (ValidationError, LookupError, AgentError, OSError, SandboxEnded, SnapshotError, VmmError, Draining,
                  DiskFull)


def lifecycle_error(kind: ErrorKind, message: str) -> E2BError:
    """A lifecycle failure of ``kind`` in E2B's shape, with what to do next."""
    return E2BError(kind.status, f"{message}; {kind.next_step}")


def to_http(exc: BaseException) -> E2BError:
    """The E2B HTTP error (control plane, envd's file routes, the code interpreter) for a runtime exception."""
    if isinstance(exc, E2BError):
        return exc
    kind = kind_for(exc)
    if kind.code in _LIFECYCLE_KINDS:
        return lifecycle_error(kind, message_for(exc))
    connect = to_connect(exc)
    status = {"unavailable": 502, "deadline_exceeded": 504}.get(connect.code, connect.status)
    return E2BError(status, connect.message)
