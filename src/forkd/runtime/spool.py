"""A bounded spool between an upload's HTTP body and the guest it is written to.

Clients see a TCP window that stays closed while the daemon does not read their body, and some
give up on that: E2B's Python SDK (reqwest under pyqwest) sets ``TCP_USER_TIMEOUT`` to 30 s, so
its kernel aborts the upload with ``ETIMEDOUT`` once the window has been shut that long. Writing
to a TCG guest under load can take longer than that per chunk. So the body is taken off the socket
at network speed into anonymous temporary files (``O_TMPFILE``: nothing is left behind by a crash),
and the guest is fed from there at its own speed; only an upload more than ``max_bytes`` ahead of
its guest waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path
from typing import IO

#: How far (bytes) one upload may run ahead of its guest before its sender has to wait.
MAX_SPOOL_BYTES = 1 << 30


def _stash(directory: Path | None, chunk: bytes) -> IO[bytes]:
    spooled = tempfile.TemporaryFile(dir=directory)
    try:
        spooled.write(chunk)
    except BaseException:
        spooled.close()
        raise
    return spooled


def _unstash(spooled: IO[bytes]) -> bytes:
    with spooled:
        spooled.seek(0)
        return spooled.read()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Spool:
    """Chunks in order, first in first out, held on disk; :meth:`put` waits while ``max_bytes`` are held.

    One producer (the body) and one consumer (the guest writer). The producer ends with
    :meth:`close`, or with :meth:`fail`, which the consumer's next :meth:`get` raises.
    """

    def __init__(self, directory: Path | None, chunk_bytes: int, max_bytes: int = MAX_SPOOL_BYTES) -> None:
        self._directory = directory
        self._items: asyncio.Queue[IO[bytes] | _Failed | None] = asyncio.Queue(maxsize=max(1, max_bytes // chunk_bytes))

    async def put(self, chunk: bytes) -> None:
        spooled = await asyncio.to_thread(_stash, self._directory, chunk)
        try:
            await self._items.put(spooled)
        except BaseException:
            spooled.close()
            raise

    async def close(self) -> None:
        await self._items.put(None)

    def fail(self, error: BaseException) -> None:
        """The body broke: the consumer gets ``error`` (chunks before it are dropped, never written)."""
        self.discard()
        self._items.put_nowait(_Failed(error))

    async def get(self) -> bytes | None:
        """The next chunk; None once the producer closed the spool."""
        item = await self._items.get()
        if isinstance(item, _Failed):
            raise item.error
        return None if item is None else await asyncio.to_thread(_unstash, item)

    def discard(self) -> None:
        """Drop every chunk still held (the upload failed or was abandoned)."""
        while not self._items.empty():
            item = self._items.get_nowait()
            if item is not None and not isinstance(item, _Failed):
                with contextlib.suppress(OSError):
                    item.close()
