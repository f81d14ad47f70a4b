"""``sandbox.files``, written once: binary-safe files of any size in a sandbox, streamed both ways (E2B's shape).

``read(format="stream")`` answers the client's chunk iterator (sync or async); a file object given to
``write`` is uploaded in pieces the flavour reads (the async one in a worker thread).
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterable
from typing import IO, Any, Literal

from forkd.sdk.errors import InvalidArgumentException
from forkd.sdk.models import EntryInfo, FileType, WriteEntry, WriteInfo
from forkd.sdk.sandbox.flavour import Flavour, SandboxRef, Steps, found, operation

Data = str | bytes | IO[Any] | list[WriteEntry] | list[dict[str, Any]]


def _check_format(format: str) -> None:
    if format not in ("text", "bytes", "stream"):
        raise InvalidArgumentException(400, "invalid_request", f"format must be text, bytes or stream, not {format!r}")


def _check_depth(depth: int) -> None:
    if depth < 1:
        raise InvalidArgumentException(400, "invalid_request", "depth must be at least 1")


def _entries(files: Iterable[WriteEntry | dict[str, Any]]) -> list[WriteEntry]:
    return [f if isinstance(f, WriteEntry) else WriteEntry(path=f["path"], data=f["data"]) for f in files]


def _whole(data: str | bytes | IO[Any]) -> bytes | None:
    """``data`` as bytes when it is already in memory; None for a file object (read in pieces)."""
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    return None


class FilesystemCore:
    """``sandbox.files``: read, write and manage files inside the sandbox (binary-safe, any size)."""

    _flavour: Flavour

    def __init__(self, sandbox: SandboxRef) -> None:
        self._sandbox = sandbox

    @operation
    def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text",
             request_timeout: float | None = None) -> Steps[Any]:
        """The file as ``str`` (text), ``bytearray`` (bytes) or an iterator of chunks as they arrive (stream)."""
        del request_timeout
        _check_format(format)
        if format == "stream":
            return self._sandbox.api.read_file_chunks(self._sandbox.sandbox_id, path)
        data = yield self._sandbox.api.read_file(self._sandbox.sandbox_id, path)
        return bytearray(data) if format == "bytes" else data.decode()

    @operation
    def write(self, path: str, data: Data, request_timeout: float | None = None) -> Steps[Any]:
        """Write one file (``str``, ``bytes`` or a file object, streamed), or a list of entries."""
        del request_timeout
        if isinstance(data, list):
            return (yield from FilesystemCore.write_files.steps(self, data))
        whole = _whole(data)
        yield self._sandbox.api.write_file(self._sandbox.sandbox_id, path,
                                           self._flavour.pieces(data) if whole is None else whole)  # type: ignore[arg-type]
        return WriteInfo(name=os.path.basename(path), path=path)

    @operation
    def write_files(self, files: Iterable[WriteEntry | dict[str, Any]]) -> Steps[builtins.list[WriteInfo]]:
        """Write several files (``WriteEntry`` or ``{"path", "data"}``), in order."""
        written = []
        for entry in _entries(files):
            written.append((yield from FilesystemCore.write.steps(self, entry.path, entry.data)))
        return written

    @operation
    def list(self, path: str, depth: int = 1) -> Steps[builtins.list[EntryInfo]]:
        """Entries under ``path``, descending ``depth`` levels (1 = just its children)."""
        _check_depth(depth)
        found = []
        for entry in map(EntryInfo.from_agent, (yield self._sandbox.api.list_files(self._sandbox.sandbox_id, path))):
            found.append(entry)
            if depth > 1 and entry.type == FileType.DIR:
                found.extend((yield from FilesystemCore.list.steps(self, entry.path, depth - 1)))
        return found

    @operation
    def exists(self, path: str) -> Steps[bool]:
        """Whether ``path`` exists in the sandbox."""
        return (yield from found(self._sandbox.api.stat, self._sandbox.sandbox_id, path))

    @operation
    def get_info(self, path: str) -> Steps[EntryInfo]:
        """``path``'s ``EntryInfo`` (``NotFoundException`` if it does not exist)."""
        return EntryInfo.from_agent((yield self._sandbox.api.stat(self._sandbox.sandbox_id, path)))

    def remove(self, path: str) -> Any:
        """Remove a file, or a directory with everything in it."""
        return self._sandbox.api.remove_file(self._sandbox.sandbox_id, path, recursive=True)

    @operation
    def rename(self, old_path: str, new_path: str) -> Steps[EntryInfo]:
        """Move ``old_path`` to ``new_path``; answers the moved entry's ``EntryInfo``."""
        yield self._sandbox.api.rename(self._sandbox.sandbox_id, old_path, new_path)
        return (yield from FilesystemCore.get_info.steps(self, new_path))

    @operation
    def make_dir(self, path: str) -> Steps[bool]:
        """Create ``path`` and its parents; ``False`` if it already existed."""
        if (yield from FilesystemCore.exists.steps(self, path)):
            return False
        yield self._sandbox.api.make_dir(self._sandbox.sandbox_id, path)
        return True
