"""What running things in a sandbox takes and gives back: command and cell specs, typed events,
results, and the reading of an agent's raw answer into them (``runtime/sessions.py`` uses them;
the daemon's routes build the specs and serialize the results).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

Stream = Literal["stdout", "stderr"]


@dataclass(frozen=True)
class Started:
    """exec: the command runs as ``pid`` (use it for stdin, signals and ``processes``)."""

    pid: int


@dataclass(frozen=True)
class Output:
    stream: Stream
    text: str


@dataclass(frozen=True)
class Data:
    """Output as the bytes the program wrote (fronts that pass bytes on: E2B's envd, a terminal)."""

    stream: Literal["stdout", "stderr", "pty"]
    data: bytes


@dataclass(frozen=True)
class Notice:
    """An event this host does not model (a newer agent's); passed on as the agent sent it."""

    name: str
    data: dict[str, Any]


Event = Started | Output | Data | Notice


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    signal: int | None
    timed_out: bool
    duration_s: float
    stdout: str = ""  # empty when the output was streamed as events instead
    stderr: str = ""
    truncated: bool = False  # output went past the call's budget; the rest was dropped
    extra: dict[str, Any] = field(default_factory=dict)  # fields a newer agent adds

    def to_dict(self) -> dict[str, Any]:
        return {**self.extra, "exit_code": self.exit_code, "signal": self.signal, "timed_out": self.timed_out,
                "duration_s": self.duration_s, "stdout": self.stdout, "stderr": self.stderr,
                "truncated": self.truncated}


@dataclass(frozen=True)
class CodeResult:
    value: str | None  # repr of the last expression, if any
    value_json: Any
    error: dict[str, Any] | None  # {name, value, traceback} when the cell raised
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**self.extra, "value": self.value, "value_json": self.value_json, "error": self.error,
                "stdout": self.stdout, "stderr": self.stderr, "truncated": self.truncated}


@dataclass(frozen=True)
class CommandSpec:
    """One command: a shell string (``/bin/sh -c``) or an argv list."""

    cmd: str | None = None
    argv: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)  # over the sandbox's default envs
    cwd: str | None = None
    stdin: bytes | None = None  # written, then closed; None leaves stdin open for write_stdin
    timeout_s: float | None = 60.0
    user: str | None = None
    warm: bool = False  # a python3 argv forked from the guest's warm template (see docs/guest-protocol.md)

    def __post_init__(self) -> None:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError("give exactly one of 'cmd' (a shell string) or 'argv' (a list)")


@dataclass(frozen=True)
class CellSpec:
    code: str
    context: str = "default"
    timeout_s: float | None = None


@dataclass(frozen=True)
class FileDownload:
    """A file being read from the guest in chunks of at most ``protocol.FILE_CHUNK_BYTES``."""

    size: int | None
    chunks: AsyncIterator[bytes]


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_command_result(raw: dict[str, Any], stdout: str, stderr: str, truncated: bool) -> CommandResult:
    known = {"exit_code", "signal", "timed_out", "duration_s", "stdout", "stderr", "truncated"}
    duration = raw.get("duration_s")
    return CommandResult(
        exit_code=_optional_int(raw.get("exit_code")) if _optional_int(raw.get("exit_code")) is not None else -1,
        signal=_optional_int(raw.get("signal")),
        timed_out=raw.get("timed_out") is True,
        duration_s=float(duration) if isinstance(duration, int | float) else 0.0,
        stdout=stdout, stderr=stderr, truncated=truncated or raw.get("truncated") is True,
        extra={k: v for k, v in raw.items() if k not in known})


def read_code_result(raw: dict[str, Any], stdout: str, stderr: str, truncated: bool) -> CodeResult:
    known = {"value", "value_json", "error", "stdout", "stderr", "truncated"}
    value, error = raw.get("value"), raw.get("error")
    return CodeResult(value=value if isinstance(value, str) else None, value_json=raw.get("value_json"),
                      error=error if isinstance(error, dict) else None, stdout=stdout, stderr=stderr,
                      truncated=truncated or raw.get("truncated") is True,
                      extra={k: v for k, v in raw.items() if k not in known})
