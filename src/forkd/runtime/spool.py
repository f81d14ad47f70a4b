"""A bounded spool between an upload's HTTP body and the guest it is written to.

Clients see a TCP window that stays closed while the daemon does not read their body, and some
give up on that: E2B's Python SDK (reqwest under pyqwest) sets ``TCP_USER_TIMEOUT`` to 30 s, so
its kernel aborts the upload with ``ETIMEDOUT`` once the window has been shut that long. Writing
to a TCG guest under load can take longer than that per chunk. So the body is taken off the socket
at network speed into one anonymous temporary file per upload (``O_TMPFILE``: nothing is left
behind by a crash), used as a ring, and the guest is fed from there at its own speed.

Every upload's spool draws on one daemon-wide :class:`SpoolBudget`: the bytes its file takes on
disk and the file itself (an open descriptor). An upload whose file would outgrow the budget, or
that finds every file slot taken, waits (its sender's TCP window closes: back-pressure); a file
that its guest has drained is truncated and its bytes given back. Growing a file first checks the
daemon's free-space floor, so a spool never fills the disk that holds ``state.db``.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import IO, TypeVar

from forkd.store.space import SpaceFloor

T = TypeVar("T")

#: Bytes of spooled upload data all uploads together may hold on disk.
DEFAULT_SPOOL_BYTES = 1 << 30
#: Uploads that may hold a spool file at once (each an open descriptor); more wait for one.
DEFAULT_SPOOL_FILES = 64


class SpoolBudget:
    """The daemon-wide bound on spooled uploads: bytes on disk and files open."""

    def __init__(self, max_bytes: int = DEFAULT_SPOOL_BYTES, max_files: int = DEFAULT_SPOOL_FILES) -> None:
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.held_bytes = 0
        self.open_files = 0
        self._changed = asyncio.Condition()

    def upload_bytes(self, chunk_bytes: int) -> int:
        """How far one upload may run ahead of its guest: a quarter of the budget (so a few stalled
        uploads cannot take it all), at least one chunk."""
        return max(chunk_bytes, self.max_bytes // 4 // chunk_bytes * chunk_bytes)

    async def take_file(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.open_files < self.max_files)
            self.open_files += 1

    async def take_bytes(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.held_bytes + n <= self.max_bytes)
            self.held_bytes += n

    async def give_back(self, n: int = 0, file: bool = False) -> None:
        async with self._changed:
            self.held_bytes -= n
            self.open_files -= file
            self._changed.notify_all()


async def _finished(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on a thread, waited for to its end even when the caller is cancelled: the file it
    works on must not be truncated or closed (its descriptor reused) under it."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.gather(work, return_exceptions=True)
        raise


def _new_file(directory: Path | None) -> IO[bytes]:
    return tempfile.TemporaryFile(dir=directory)  # O_TMPFILE where the filesystem has it: no name at all


def _pwrite_ring(f: IO[bytes], data: bytes, position: int, capacity: int) -> None:
    at = position % capacity
    first = data[:capacity - at]
    os.pwrite(f.fileno(), first, at)
    if len(first) < len(data):
        os.pwrite(f.fileno(), data[len(first):], 0)


def _pread_ring(f: IO[bytes], n: int, position: int, capacity: int) -> bytes:
    at = position % capacity
    first = os.pread(f.fileno(), min(n, capacity - at), at)
    return first + os.pread(f.fileno(), n - len(first), 0) if len(first) < n else first


class Spool:
    """Bytes in order, first in first out, held in one file; :meth:`put` waits while the upload is
    ``upload_bytes`` ahead of its guest, or the budget is spent.

    One producer (the body) and one consumer (the guest writer). The producer ends with
    :meth:`close`, or with :meth:`fail`, which the consumer's next :meth:`get` raises. The owner
    calls :meth:`release` once both are done.
    """

    def __init__(self, directory: Path | None, chunk_bytes: int, budget: SpoolBudget,
                 space: SpaceFloor | None = None) -> None:
        self._directory = directory
        self._chunk_bytes = chunk_bytes
        self._budget = budget
        self._space = space
        self._capacity = budget.upload_bytes(chunk_bytes)
        self._file: IO[bytes] | None = None
        self._head = self._tail = 0  # bytes read and written since the file was last emptied
        self._extent = 0  # bytes of the file in use (taken from the budget)
        self._closed = False
        self._error: BaseException | None = None
        self._changed = asyncio.Condition()
        # Held by every read, write, truncation and close of the file, never while waiting for the budget.
        self._io = asyncio.Lock()

    async def _open(self) -> IO[bytes]:
        if self._file is not None:
            return self._file
        await self._budget.take_file()
        try:
            self._file = opened = await _finished(_new_file, self._directory)
        except BaseException:
            await self._budget.give_back(file=True)
            raise
        return opened

    async def put(self, data: bytes) -> None:
        spooled = await self._open()
        async with self._changed:
            await self._changed.wait_for(lambda: self._tail - self._head + len(data) <= self._capacity)
        reserved = 0  # budget bytes taken for this write's growth of the file
        try:
            while True:
                async with self._io:
                    growth = max(0, min(self._capacity, self._tail + len(data)) - self._extent)
                    if growth <= reserved:  # (the file may have been emptied while the budget was awaited)
                        if growth and self._space is not None and self._directory is not None:
                            await _finished(self._space.check, self._directory, growth, "spooling an upload")
                        await _finished(_pwrite_ring, spooled, data, self._tail, self._capacity)
                        self._extent += growth
                        reserved -= growth
                        self._tail += len(data)  # under the lock: a drained file is never emptied under it
                        break
                await self._budget.take_bytes(growth - reserved)
                reserved = growth
        finally:
            if reserved:
                await self._budget.give_back(reserved)
        async with self._changed:
            self._changed.notify_all()

    async def close(self) -> None:
        async with self._changed:
            self._closed = True
            self._changed.notify_all()

    async def fail(self, error: BaseException) -> None:
        """The body broke: the consumer gets ``error`` (bytes before it are dropped, never written)."""
        async with self._changed:
            self._error = error
            self._changed.notify_all()

    async def get(self) -> bytes | None:
        """The next piece of at most ``chunk_bytes``; None once the producer closed the spool and all was read."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._error is not None or self._tail > self._head or self._closed)
            if self._error is not None:
                raise self._error
            if self._tail == self._head:
                return None
            n, at = min(self._chunk_bytes, self._tail - self._head), self._head
        async with self._io:
            assert self._file is not None
            piece = await _finished(_pread_ring, self._file, n, at, self._capacity)
        async with self._changed:
            self._head += n
            self._changed.notify_all()
            drained = self._head == self._tail
        if drained:
            await self._empty()
        return piece

    async def _empty(self) -> None:
        """A drained file is cut to nothing and its bytes given back to the budget (unless the producer
        wrote more meanwhile)."""
        async with self._io:
            if self._head != self._tail or self._extent == 0 or self._file is None:
                return
            await _finished(self._file.truncate, 0)
            freed, self._extent = self._extent, 0
            self._head = self._tail = 0
        await self._budget.give_back(freed)

    async def release(self) -> None:
        """Close the file and give its bytes and its slot back (the upload is over, or abandoned)."""
        async with self._io:
            spooled, self._file = self._file, None
            freed, self._extent = self._extent, 0
            if spooled is not None:
                await _finished(spooled.close)
        if spooled is not None:
            await self._budget.give_back(freed, file=True)
