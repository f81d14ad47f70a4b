"""What the daemon answers, as ``TypedDict``s: the ``Controller``'s answers are the daemon's JSON as plain dicts
(as they always were), and these name their fields for type checkers. Fields a daemon adds later are there at
run time without being declared; the schema of record is docs/openapi.json."""

from __future__ import annotations

from typing import Any, TypedDict


class Health(TypedDict):
    ok: bool


class Version(TypedDict, total=False):
    forkd: str
    vmm: str
    vmm_version: str
    accelerator: str


class MemoryUse(TypedDict):
    pss_kib: int
    private_dirty_kib: int
    rss_kib: int


class _SandboxFields(TypedDict):
    id: str
    snapshot_tag: str
    status: str
    pid: int | None
    created_at: float


class SandboxRecord(_SandboxFields, total=False):
    """A sandbox as ``sandboxes()``, ``sandbox(id)`` and ``fork`` answer it."""

    end_at: float | None
    owner: str | None
    metadata: dict[str, str]
    memory: MemoryUse | None
    seconds_to_answer: float | None
    timings: dict[str, float] | None


class ChildError(TypedDict):
    index: int
    code: str
    message: str


class ForkAnswer(TypedDict):
    """``fork``'s answer: the children that started, and one error per child that did not (an older daemon
    sends a bare string; ``forkd.Failure.from_answer`` reads both)."""

    sandboxes: list[SandboxRecord]
    errors: list[ChildError | str]


class DiskUsage(TypedDict):
    logical_bytes: int
    physical_bytes: int


class _SnapshotFields(TypedDict):
    tag: str
    status: str
    image: str
    path: str
    created_at: float


class SnapshotRecord(_SnapshotFields, total=False):
    """A snapshot as ``snapshots()``, ``snapshot(tag)``, ``branch``, ``compact`` and ``snapshot_diff`` answer it."""

    parent_tag: str | None
    mode: str
    disk: DiskUsage
    digest: str


class PoolRecord(TypedDict):
    tag: str
    size: int
    ready: int
    starting: int
    warm: bool
    memory: MemoryUse
    members: list[str]


class CommandOutcome(TypedDict, total=False):
    """A finished command (``exec``): its output unless it was streamed, and how it ended."""

    exit_code: int
    signal: int | None
    timed_out: bool
    duration_s: float
    stdout: str
    stderr: str
    truncated: bool


class EvalAnswer(TypedDict, total=False):
    value: str | None
    value_json: Any
    error: dict[str, Any] | None


class ContextRecord(TypedDict, total=False):
    id: str
    language: str
    cwd: str | None


class FileEntry(TypedDict):
    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: float
