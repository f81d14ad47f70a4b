"""``AsyncSandbox.files``: the core's files (``sandbox/filesystem.py``) as coroutines; ``read(format="stream")``
answers an async iterator, and a file object is read in a worker thread, piece by piece."""

from __future__ import annotations

from forkd.sdk.async_controller import ASYNC
from forkd.sdk.sandbox.filesystem import FilesystemCore


class AsyncFilesystem(FilesystemCore):
    _flavour = ASYNC
