"""``Sandbox.files``: the core's files (``sandbox/filesystem.py``), run by the sync flavour."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal, overload

from forkd.sdk.controller import SYNC
from forkd.sdk.sandbox.filesystem import FilesystemCore
from forkd.sdk.sandbox.flavour import SyncSide


class Filesystem(FilesystemCore, SyncSide):
    """``sandbox.files``: files inside the sandbox (binary-safe, any size); the core documents each method."""

    _flavour = SYNC

    if TYPE_CHECKING:
        @overload  # type: ignore[override]
        def read(self, path: str, format: Literal["text"] = "text", request_timeout: float | None = None) -> str: ...

        @overload
        def read(self, path: str, format: Literal["bytes"], request_timeout: float | None = None) -> bytearray: ...

        @overload
        def read(self, path: str, format: Literal["stream"],
                 request_timeout: float | None = None) -> Iterator[bytes]: ...

        def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text",
                 request_timeout: float | None = None) -> str | bytearray | Iterator[bytes]: ...

        def remove(self, path: str) -> None: ...
