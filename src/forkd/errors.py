"""Every kind of error forkd reports, in one table: its code, its HTTP status and what to do next.

The daemon answers ``{"error": {"code", "message"}}`` with the kind's status; clients (the
``Controller``, the SDK's exception classes, the MCP tools) read the code back through this table,
so a code means the same thing on every side of the API. A message says what went wrong in this
case; the kind's ``next_step`` says what to do about any error of that kind.

Every exception forkd raises on purpose carries its kind: a ``kind`` attribute holding one of
these codes (a class attribute, or a property where the code comes with the error, as the guest
agent's do). ``kind_for`` reads it; the daemon, the E2B front and MCP all map exceptions through it.

Stdlib only and importing nothing from forkd: every layer may depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

#: Which client exception family a kind belongs to (the SDK names its classes after E2B's).
Family = Literal["invalid_argument", "authentication", "not_found", "conflict", "timeout", "rate_limit", "other"]


@dataclass(frozen=True)
class ErrorKind:
    code: str
    status: int
    family: Family
    next_step: str

    def body(self, message: str, **details: object) -> dict[str, object]:
        """The JSON error body the daemon answers with."""
        return {"error": {"code": self.code, "message": message, **details}}


_KINDS = (
    ErrorKind("invalid_request", 400, "invalid_argument",
              "fix the named field or value (the schema is in docs/api.md and /openapi.json) and send it again"),
    ErrorKind("malformed_body", 400, "invalid_argument", "send the body as one JSON object"),
    ErrorKind("bad_request", 400, "invalid_argument", "fix the argument the guest agent named"),
    ErrorKind("os_error", 400, "invalid_argument", "check the path or command inside the sandbox (it failed there)"),
    ErrorKind("unauthorized", 401, "authentication", "set FORKD_TOKEN to the daemon's bearer token"),
    ErrorKind("not_found", 404, "not_found",
              "list what exists (`forkd ls`, `forkd snapshots`, `forkd workspace ls`) and use one of those"),
    ErrorKind("snapshot_not_found", 404, "not_found",
              "GET /v1/node of each node lists the digests it holds: fork where it is held, or pull it from "
              "such a node first (POST /v1/node/pull)"),
    ErrorKind("no_route", 404, "not_found", "this daemon does not offer that route: upgrade forkd and restart it"),
    ErrorKind("method_not_allowed", 405, "invalid_argument", "use a method the route accepts (see docs/api.md)"),
    ErrorKind("conflict", 409, "conflict", "pick another tag or name, or wait for the operation holding it to finish"),
    ErrorKind("sandbox_ended", 409, "conflict",
              "the sandbox ended (timeout or kill) while this ran: start a new one and try again"),
    ErrorKind("snapshot_mismatch", 409, "conflict",
              "recreate the snapshot on this host (it was saved by another VMM setup)"),
    ErrorKind("incompatible_snapshot", 409, "conflict",
              "move snapshots only between nodes with the same compat key (GET /v1/node), or create it on this node"),
    ErrorKind("idempotency_conflict", 409, "conflict",
              "send the same request again to get its answer, or use a new idempotency key for a new fork"),
    ErrorKind("snapshot_corrupt", 409, "conflict", "remove the snapshot with `forkd rmi TAG` and recreate it"),
    ErrorKind("body_too_large", 413, "invalid_argument",
              "send less: upload big files with PUT /files, which streams them in chunks"),
    ErrorKind("snapshot_error", 400, "invalid_argument", "fix what the message names and retry the snapshot operation"),
    ErrorKind("pack_refused", 400, "invalid_argument", "use a pack made by forkd for this host's VMM setup"),
    ErrorKind("image_error", 400, "invalid_argument", "fix the image spec the message names, then build again"),
    ErrorKind("unknown_op", 400, "invalid_argument",
              "the guest agent is older than this daemon: recreate the snapshot from a rebuilt image"),
    ErrorKind("internal", 500, "other", "report it with the daemon log; retrying may work"),
    ErrorKind("vmm_error", 500, "other", "check `forkd doctor` and the daemon log, then retry"),
    ErrorKind("agent_unavailable", 502, "other",
              "the sandbox's guest agent is gone: kill the sandbox and spawn a new one"),
    ErrorKind("reseed_failed", 500, "other", "rebuild the image (`forkd image build --force`) so its agent runs "
              "as root, then recreate the snapshot"),
    ErrorKind("isolation_error", 500, "other",
              "check `forkd doctor` (network namespaces, cgroups) and the daemon log, then retry"),
    ErrorKind("peer_error", 502, "other",
              "check the peer's URL, its token (source_token) and its daemon's log, or pull from another node"),
    ErrorKind("busy", 503, "rate_limit", "retry in a moment: the daemon is over a concurrency cap"),
    ErrorKind("draining", 503, "other", "this node is draining: fork on another node"),
    ErrorKind("timeout", 504, "timeout", "raise timeout_s, or split the work into shorter calls"),
    ErrorKind("disk_full", 507, "other", "free disk space under FORKD_HOME (remove snapshots with `forkd rmi`)"),
    # Client side only: no daemon answered, or its stream ended early.
    ErrorKind("unreachable", 0, "other",
              "start the daemon with `forkd daemon` (as root), or point FORKD_URL at a running one"),
    ErrorKind("truncated", 0, "other", "the daemon stopped mid-answer: check its log and retry"),
)

KINDS: dict[str, ErrorKind] = {kind.code: kind for kind in _KINDS}
INTERNAL = KINDS["internal"]


def kind_of(code: str) -> ErrorKind:
    """The kind of an error code; unknown codes (a newer daemon's) count as internal."""
    return KINDS.get(code, INTERNAL)


def kind_for_status(status: int) -> ErrorKind:
    """The kind a bare HTTP status stands for (an answer without a forkd error body)."""
    if status == 404:
        return KINDS["no_route"]
    return next((kind for kind in _KINDS if kind.status == status), INTERNAL)


def kind_for(exc: BaseException) -> ErrorKind:
    """The kind an exception carries (its ``kind`` code); a bare ``LookupError`` is not_found, anything else internal."""
    code = getattr(exc, "kind", None)
    if isinstance(code, str):
        return kind_of(code)
    return KINDS["not_found"] if isinstance(exc, LookupError) else INTERNAL


def message_for(exc: BaseException) -> str:
    """What to tell a caller about ``exc``: the message it came with (the guest agent's errors carry one),
    else its text, with the class named when it is unexpected."""
    message = getattr(exc, "message", None)
    if isinstance(message, str):
        return message
    return f"{type(exc).__name__}: {exc}" if kind_for(exc) is INTERNAL else str(exc)


@dataclass(frozen=True)
class Failure:
    """An error reported as data instead of raised (one failed child of a fork batch): a code of this
    table and what happened. ``str()`` is the message, so it reads well in a sentence."""

    code: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        return cls(kind_for(exc).code, message_for(exc))

    @classmethod
    def from_answer(cls, error: Any) -> Failure:
        """A ``{"code", "message"}`` object from an answer; an older daemon's bare string is internal."""
        if isinstance(error, dict):
            return cls(str(error.get("code") or INTERNAL.code), str(error.get("message") or "failed"))
        return cls(INTERNAL.code, str(error or "failed"))

    @property
    def kind(self) -> ErrorKind:
        return kind_of(self.code)

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}

    def __str__(self) -> str:
        return self.message
