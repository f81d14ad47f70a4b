"""What the Sandbox SDK returns, shaped like E2B's classes of the same names so E2B code reads them unchanged."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from forkd.errors import Failure
from forkd.sdk.errors import ForkdError


@dataclass
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    error: str | None = None
    truncated: bool = False  # the command printed past the daemon's output budget; the rest was dropped


class CommandExitException(ForkdError):
    """A command exited non-zero; carries its ``CommandResult`` fields like E2B's exception."""

    def __init__(self, result: CommandResult) -> None:
        message = result.error or f"command exited with code {result.exit_code}"
        if result.stderr.strip():
            message += f": {result.stderr.strip()[-500:]}"
        super().__init__(0, "command_exit", message)
        self.stdout = result.stdout
        self.stderr = result.stderr
        self.exit_code = result.exit_code
        self.error = result.error


@dataclass
class ProcessInfo:
    pid: int
    cmd: str
    args: list[str]
    running: bool
    exit_code: int | None
    started_at: float | None


class FileType(str, Enum):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"


@dataclass
class EntryInfo:
    name: str
    type: FileType
    path: str
    size: int
    mode: int
    permissions: str
    modified_time: dt.datetime

    @classmethod
    def from_agent(cls, entry: dict[str, Any]) -> EntryInfo:
        return cls(name=entry["name"], type=FileType(entry["type"]), path=entry["path"], size=entry["size"],
                   mode=entry["mode"], permissions=_permissions(entry["mode"]),
                   modified_time=dt.datetime.fromtimestamp(entry["mtime"], dt.timezone.utc))


def _permissions(mode: int) -> str:
    return "".join(flag if mode & (1 << (8 - i)) else "-" for i, flag in enumerate("rwxrwxrwx"))


@dataclass
class WriteInfo:
    name: str
    path: str
    type: FileType = FileType.FILE


@dataclass
class WriteEntry:
    path: str
    data: str | bytes


@dataclass
class SandboxInfo:
    sandbox_id: str
    template_id: str
    metadata: dict[str, str]
    started_at: dt.datetime
    end_at: dt.datetime | None
    state: str

    @classmethod
    def from_daemon(cls, sandbox: dict[str, Any]) -> SandboxInfo:
        end_at = sandbox.get("end_at")
        return cls(sandbox_id=sandbox["id"], template_id=sandbox["snapshot_tag"],
                   metadata=dict(sandbox.get("metadata") or {}),
                   started_at=dt.datetime.fromtimestamp(sandbox["created_at"], dt.timezone.utc),
                   end_at=None if end_at is None else dt.datetime.fromtimestamp(end_at, dt.timezone.utc),
                   state=sandbox["status"])


@dataclass
class OutputMessage:
    """One line a cell printed (``run_code``'s ``on_stdout``/``on_stderr`` receive these)."""

    line: str
    timestamp: int  # ns since the epoch, when the host received it
    error: bool = False

    def __str__(self) -> str:
        return self.line


RESULT_FORMATS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json", "javascript", "chart")


@dataclass
class Result:
    """One rich result of a cell, as E2B's code interpreter returns it: ``display(obj)`` or the cell's
    value (``is_main_result``). ``text`` is the repr; ``png``/``jpeg``/``pdf`` are base64; ``json`` the
    object's JSON form (for the main result: the value itself when JSON-able)."""

    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: Any = None
    javascript: str | None = None
    chart: Any = None
    extra: Any = None
    is_main_result: bool = True

    @classmethod
    def from_agent(cls, result: dict[str, Any]) -> Result:
        known = {name: result[name] for name in (*RESULT_FORMATS, "extra", "is_main_result") if name in result}
        return cls(**known)

    def formats(self) -> list[str]:
        return [name for name in RESULT_FORMATS if getattr(self, name) is not None]

    def __str__(self) -> str:
        return self.text or ""


@dataclass
class Context:
    """A code-interpreter context (E2B's ``Context``): its own interpreter process, forked warm."""

    id: str
    language: str
    cwd: str | None

    @classmethod
    def from_agent(cls, context: dict[str, Any]) -> Context:
        return cls(id=context["id"], language=context["language"], cwd=context.get("cwd"))


@dataclass
class Logs:
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@dataclass
class ExecutionError:
    """An exception the cell raised, or ``InterpreterCrashed`` (then ``signal`` names what killed it and
    ``context`` says whether the context was ``restored`` from the warm template or ``lost``)."""

    name: str
    value: str
    traceback: str
    signal: int | None = None
    context: str | None = None

    @classmethod
    def from_agent(cls, error: dict[str, Any]) -> ExecutionError:
        return cls(name=error["name"], value=error["value"], traceback=error.get("traceback", ""),
                   signal=error.get("signal"), context=error.get("context"))


@dataclass
class Execution:
    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None

    @property
    def text(self) -> str | None:
        """The main result's text, as in E2B's code interpreter."""
        return next((r.text for r in self.results if r.is_main_result), None)


class CodeError(ForkdError):
    """``eval`` of an expression that raised; ``error`` holds name, value and traceback."""

    def __init__(self, error: ExecutionError) -> None:
        super().__init__(0, "code_error", f"{error.name}: {error.value}")
        self.error = error


@dataclass
class ChildOutcome:
    """One child of a fork: its ``sandbox`` (the daemon's record) or the ``error`` that stopped it (a
    ``Failure``: ``code``, a kind of ``forkd.errors``, and ``message``), and ``timings`` (seconds per spawn
    stage) either way. ``index`` is its place in the request (0-based)."""

    index: int
    sandbox: dict[str, Any] | None = None
    error: Failure | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def sandbox_id(self) -> str | None:
        return None if self.sandbox is None else str(self.sandbox["id"])

    @classmethod
    def from_daemon(cls, child: dict[str, Any]) -> ChildOutcome:
        """A ``{"index", "sandbox" | "error", "timings"}`` line of a streamed fork."""
        return cls(index=int(child["index"]), sandbox=child.get("sandbox"),
                   error=None if child.get("sandbox") is not None else Failure.from_answer(child.get("error")),
                   timings=dict(child.get("timings") or {}))


@dataclass
class ForkOutcome:
    """Every child of one fork request, in request order; a failed child does not fail the others."""

    children: list[ChildOutcome]

    @classmethod
    def from_children(cls, children: list[dict[str, Any]]) -> ForkOutcome:
        return cls(sorted(map(ChildOutcome.from_daemon, children), key=lambda child: child.index))

    @property
    def started(self) -> list[ChildOutcome]:
        return [child for child in self.children if child.error is None]

    @property
    def failed(self) -> list[ChildOutcome]:
        return [child for child in self.children if child.error is not None]

    def to_kill(self) -> list[str]:
        """The children ``fork`` must kill before raising: all that started, if any child failed."""
        return [str(child.sandbox_id) for child in self.started] if self.failed or not self.children else []

    def sandbox_ids(self) -> list[str]:
        """Every child's sandbox id; ``ForkFailed`` if any child failed (after ``to_kill`` were killed)."""
        if self.failed or not self.children:
            raise ForkFailed(self)
        return [str(child.sandbox_id) for child in self.children]


class ForkFailed(ForkdError):
    """Some children of a ``fork`` did not start (the ones that did were killed); ``outcome`` says which."""

    def __init__(self, outcome: ForkOutcome) -> None:
        failed = outcome.failed
        detail = "; ".join(f"child {child.index} ({child.error.code}): {child.error}"
                           for child in failed if child.error is not None) or "no child started"
        super().__init__(500, "fork_failed", f"{len(failed)} of {len(outcome.children)} children failed: {detail}")
        self.outcome = outcome
