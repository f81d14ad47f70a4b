"""``sandbox.files``: binary-safe files of any size in a sandbox, streamed both ways (E2B's shape)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import IO, Any, Literal

from forkd.sdk.controller import Controller
from forkd.sdk.errors import InvalidArgumentException, NotFoundException
from forkd.sdk.models import EntryInfo, WriteEntry, WriteInfo
from forkd.sdk.ref import SandboxRef

UPLOAD_PIECE_BYTES = 1 << 20


class Filesystem:
    """``sandbox.files``: read, write and manage files inside the sandbox (binary-safe, any size)."""

    def __init__(self, sandbox: SandboxRef) -> None:
        self._sandbox = sandbox

    @property
    def _api(self) -> Controller:
        return self._sandbox.api

    @property
    def _id(self) -> str:
        return self._sandbox.sandbox_id

    def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text",
             request_timeout: float | None = None) -> str | bytearray | Iterator[bytes]:
        del request_timeout
        if format == "stream":
            return self._api.read_file_chunks(self._id, path)
        data = self._api.read_file(self._id, path)
        if format == "bytes":
            return bytearray(data)
        if format == "text":
            return data.decode()
        raise InvalidArgumentException(400, "invalid_request", f"format must be text, bytes or stream, not {format!r}")

    def write(self, path: str, data: str | bytes | IO[Any] | list[WriteEntry] | list[dict[str, Any]],
              request_timeout: float | None = None) -> WriteInfo | list[WriteInfo]:
        """Write one file (``str``, ``bytes`` or a file object, streamed), or a list of entries."""
        del request_timeout
        if isinstance(data, list):
            return self.write_files(data)
        self._api.write_file(self._id, path, _pieces(data))
        return WriteInfo(name=os.path.basename(path), path=path)

    def write_files(self, files: Iterable[WriteEntry | dict[str, Any]]) -> list[WriteInfo]:
        entries = [f if isinstance(f, WriteEntry) else WriteEntry(path=f["path"], data=f["data"]) for f in files]
        return [self.write(e.path, e.data) for e in entries]  # type: ignore[misc]

    def list(self, path: str, depth: int = 1) -> list[EntryInfo]:
        """Entries under ``path``, descending ``depth`` levels (1 = just its children)."""
        if depth < 1:
            raise InvalidArgumentException(400, "invalid_request", "depth must be at least 1")
        found = []
        for entry in map(EntryInfo.from_agent, self._api.list_files(self._id, path)):
            found.append(entry)
            if depth > 1 and entry.type.value == "dir":
                found.extend(self.list(entry.path, depth - 1))
        return found

    def exists(self, path: str) -> bool:
        try:
            self._api.stat(self._id, path)
        except NotFoundException:
            return False
        return True

    def get_info(self, path: str) -> EntryInfo:
        return EntryInfo.from_agent(self._api.stat(self._id, path))

    def remove(self, path: str) -> None:
        """Remove a file, or a directory with everything in it."""
        self._api.remove_file(self._id, path, recursive=True)

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        self._api.rename(self._id, old_path, new_path)
        return self.get_info(new_path)

    def make_dir(self, path: str) -> bool:
        """Create ``path`` and its parents; ``False`` if it already existed."""
        if self.exists(path):
            return False
        self._api.make_dir(self._id, path)
        return True


def _pieces(data: str | bytes | IO[Any]) -> bytes | Iterator[bytes]:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)

    def read_all() -> Iterator[bytes]:
        while piece := data.read(UPLOAD_PIECE_BYTES):
            yield piece.encode() if isinstance(piece, str) else piece

    return read_all()
