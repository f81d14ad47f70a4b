"""``sandbox.files``: binary-safe files of any size in a sandbox, streamed both ways (E2B's shape).

``Filesystem`` for ``Sandbox``, ``AsyncFilesystem`` for ``AsyncSandbox``; argument checks and answer
shapes are the module's functions, shared by both.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import IO, Any, Literal

from forkd.sdk.errors import InvalidArgumentException, NotFoundException
from forkd.sdk.models import EntryInfo, FileType, WriteEntry, WriteInfo
from forkd.sdk.ref import AsyncSandboxRef, SandboxRef

UPLOAD_PIECE_BYTES = 1 << 20
Data = str | bytes | IO[Any] | list[WriteEntry] | list[dict[str, Any]]


def _check_format(format: str, streams: bool = True) -> None:
    allowed = ("text", "bytes", "stream") if streams else ("text", "bytes")
    if format not in allowed:
        raise InvalidArgumentException(400, "invalid_request", f"format must be {' or '.join(allowed)}, "
                                                               f"not {format!r}")


def _formatted(data: bytes, format: str) -> str | bytearray:
    return bytearray(data) if format == "bytes" else data.decode()


def _check_depth(depth: int) -> None:
    if depth < 1:
        raise InvalidArgumentException(400, "invalid_request", "depth must be at least 1")


def _entries(files: Iterable[WriteEntry | dict[str, Any]]) -> list[WriteEntry]:
    return [f if isinstance(f, WriteEntry) else WriteEntry(path=f["path"], data=f["data"]) for f in files]


def _written(path: str) -> WriteInfo:
    return WriteInfo(name=os.path.basename(path), path=path)


def _whole(data: str | bytes | IO[Any]) -> bytes | None:
    """``data`` as bytes when it is already in memory; None for a file object (read in pieces)."""
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    return None


def _piece(piece: str | bytes) -> bytes:
    return piece.encode() if isinstance(piece, str) else piece


class Filesystem:
    """``sandbox.files``: read, write and manage files inside the sandbox (binary-safe, any size)."""

    def __init__(self, sandbox: SandboxRef) -> None:
        self._sandbox = sandbox

    def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text",
             request_timeout: float | None = None) -> str | bytearray | Iterator[bytes]:
        del request_timeout
        _check_format(format)
        if format == "stream":
            return self._sandbox.api.read_file_chunks(self._sandbox.sandbox_id, path)
        return _formatted(self._sandbox.api.read_file(self._sandbox.sandbox_id, path), format)

    def write(self, path: str, data: Data, request_timeout: float | None = None) -> WriteInfo | list[WriteInfo]:
        """Write one file (``str``, ``bytes`` or a file object, streamed), or a list of entries."""
        del request_timeout
        if isinstance(data, list):
            return self.write_files(data)
        whole = _whole(data)

        def pieces() -> Iterator[bytes]:
            while piece := data.read(UPLOAD_PIECE_BYTES):  # type: ignore[union-attr]
                yield _piece(piece)

        self._sandbox.api.write_file(self._sandbox.sandbox_id, path, pieces() if whole is None else whole)
        return _written(path)

    def write_files(self, files: Iterable[WriteEntry | dict[str, Any]]) -> list[WriteInfo]:
        return [self.write(e.path, e.data) for e in _entries(files)]  # type: ignore[misc]

    def list(self, path: str, depth: int = 1) -> list[EntryInfo]:
        """Entries under ``path``, descending ``depth`` levels (1 = just its children)."""
        _check_depth(depth)
        found = []
        for entry in map(EntryInfo.from_agent, self._sandbox.api.list_files(self._sandbox.sandbox_id, path)):
            found.append(entry)
            if depth > 1 and entry.type == FileType.DIR:
                found.extend(self.list(entry.path, depth - 1))
        return found

    def exists(self, path: str) -> bool:
        try:
            self.get_info(path)
        except NotFoundException:
            return False
        return True

    def get_info(self, path: str) -> EntryInfo:
        return EntryInfo.from_agent(self._sandbox.api.stat(self._sandbox.sandbox_id, path))

    def remove(self, path: str) -> None:
        """Remove a file, or a directory with everything in it."""
        self._sandbox.api.remove_file(self._sandbox.sandbox_id, path, recursive=True)

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        self._sandbox.api.rename(self._sandbox.sandbox_id, old_path, new_path)
        return self.get_info(new_path)

    def make_dir(self, path: str) -> bool:
        """Create ``path`` and its parents; ``False`` if it already existed."""
        if self.exists(path):
            return False
        self._sandbox.api.make_dir(self._sandbox.sandbox_id, path)
        return True


class AsyncFilesystem:
    """``AsyncSandbox.files``: the methods of ``Filesystem`` as coroutines; ``read(format="stream")``
    answers an async iterator, and a file object is read in a worker thread, piece by piece."""

    def __init__(self, sandbox: AsyncSandboxRef) -> None:
        self._sandbox = sandbox

    async def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text",
                   request_timeout: float | None = None) -> str | bytearray | AsyncIterator[bytes]:
        del request_timeout
        _check_format(format)
        if format == "stream":
            return self._sandbox.api.read_file_chunks(self._sandbox.sandbox_id, path)
        return _formatted(await self._sandbox.api.read_file(self._sandbox.sandbox_id, path), format)

    async def write(self, path: str, data: Data,
                    request_timeout: float | None = None) -> WriteInfo | list[WriteInfo]:
        del request_timeout
        if isinstance(data, list):
            return await self.write_files(data)
        whole = _whole(data)

        async def pieces() -> AsyncIterator[bytes]:
            while piece := await asyncio.to_thread(data.read, UPLOAD_PIECE_BYTES):  # type: ignore[union-attr]
                yield _piece(piece)

        await self._sandbox.api.write_file(self._sandbox.sandbox_id, path, pieces() if whole is None else whole)
        return _written(path)

    async def write_files(self, files: Iterable[WriteEntry | dict[str, Any]]) -> list[WriteInfo]:
        return [await self.write(e.path, e.data) for e in _entries(files)]  # type: ignore[misc]

    async def list(self, path: str, depth: int = 1) -> list[EntryInfo]:
        _check_depth(depth)
        found = []
        for entry in map(EntryInfo.from_agent, await self._sandbox.api.list_files(self._sandbox.sandbox_id, path)):
            found.append(entry)
            if depth > 1 and entry.type == FileType.DIR:
                found.extend(await self.list(entry.path, depth - 1))
        return found

    async def exists(self, path: str) -> bool:
        try:
            await self.get_info(path)
        except NotFoundException:
            return False
        return True

    async def get_info(self, path: str) -> EntryInfo:
        return EntryInfo.from_agent(await self._sandbox.api.stat(self._sandbox.sandbox_id, path))

    async def remove(self, path: str) -> None:
        await self._sandbox.api.remove_file(self._sandbox.sandbox_id, path, recursive=True)

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        await self._sandbox.api.rename(self._sandbox.sandbox_id, old_path, new_path)
        return await self.get_info(new_path)

    async def make_dir(self, path: str) -> bool:
        if await self.exists(path):
            return False
        await self._sandbox.api.make_dir(self._sandbox.sandbox_id, path)
        return True
