"""``AsyncSandbox.files``: the core's files (``sandbox/filesystem.py``) as coroutines; ``read(format="stream")``
answers an async iterator, and a file object is read in a worker thread, piece by piece."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal, overload

from forkd.sdk.async_controller import ASYNC
from forkd.sdk.sandbox.filesystem import FilesystemCore
from forkd.sdk.sandbox.flavour import AsyncSide


class AsyncFilesystem(FilesystemCore, AsyncSide):
    """``sandbox.files`` for asyncio: each method a coroutine; the core documents each method."""

    _flavour = ASYNC

    if TYPE_CHECKING:
        @overload  # type: ignore[override]
        async def read(self, path: str, format: Literal["text"] = "text",
                       request_timeout: float | None = None) -> str: ...

        @overload
        async def read(self, path: str, format: Literal["bytes"],
                       request_timeout: float | None = None) -> bytearray: ...

        @overload
        async def read(self, path: str, format: Literal["stream"],
                       request_timeout: float | None = None) -> AsyncIterator[bytes]: ...

        async def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text",
                       request_timeout: float | None = None) -> str | bytearray | AsyncIterator[bytes]: ...

        async def remove(self, path: str) -> None: ...
