"""The guest operations the E2B front needs, called on a running sandbox the way the REST API calls them.

A thin seam: every operation goes through the sandbox's one agent connection, with the same ops,
arguments and chunking as ``forkd.daemon.app``, so both fronts drive the guest identically.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from forkd.guest import protocol
from forkd.runtime.agent_client import EventHandler
from forkd.runtime.sandboxes import LiveSandbox

FILE_TIMEOUT_S = 120.0


async def call(live: LiveSandbox, op: str, args: dict[str, Any], timeout: float | None = 60.0,
               on_event: EventHandler | None = None) -> dict[str, Any]:
    return await live.agent.call(op, args, timeout=timeout, on_event=on_event)


async def read_file(live: LiveSandbox, path: str) -> tuple[int, AsyncIterator[bytes]]:
    """The file's size and its bytes in agent-sized chunks; a missing file fails before any byte."""
    first = await call(live, protocol.OP_FILES_READ, {"path": path, "offset": 0}, FILE_TIMEOUT_S)

    async def chunks() -> AsyncIterator[bytes]:
        chunk, offset = first, 0
        while True:
            data = protocol.b64decode(chunk["data_b64"])
            offset += len(data)
            yield data
            if chunk.get("eof") or not data:
                return
            chunk = await call(live, protocol.OP_FILES_READ, {"path": path, "offset": offset}, FILE_TIMEOUT_S)

    return int(first.get("size", 0)), chunks()


class FileWriter:
    """Writes a file in agent-sized pieces as its bytes arrive (the first piece truncates it)."""

    def __init__(self, live: LiveSandbox, path: str) -> None:
        self.live, self.path, self.written = live, path, 0
        self._buffer = bytearray()

    async def _send(self, piece: bytes) -> None:
        await call(self.live, protocol.OP_FILES_WRITE, {"path": self.path, "data_b64": protocol.b64encode(piece),
                                                        "offset": self.written, "truncate": self.written == 0},
                   FILE_TIMEOUT_S)
        self.written += len(piece)

    async def feed(self, data: bytes) -> None:
        self._buffer.extend(data)
        while len(self._buffer) >= protocol.FILE_CHUNK_BYTES:
            await self._send(bytes(self._buffer[:protocol.FILE_CHUNK_BYTES]))
            del self._buffer[:protocol.FILE_CHUNK_BYTES]

    async def close(self) -> int:
        """Write what is left (an empty file too); returns the file's size."""
        if self._buffer or self.written == 0:
            await self._send(bytes(self._buffer))
            self._buffer.clear()
        return self.written


async def write_file(live: LiveSandbox, path: str, parts: AsyncIterator[bytes]) -> int:
    """Write a streamed body to ``path`` (parents created); returns its size."""
    writer = FileWriter(live, path)
    async for part in parts:
        await writer.feed(part)
    return await writer.close()
