"""``Sandbox.files``: the core's files (``sandbox/filesystem.py``), run by the sync flavour."""

from __future__ import annotations

from forkd.sdk.controller import SYNC
from forkd.sdk.sandbox.filesystem import FilesystemCore


class Filesystem(FilesystemCore):
    _flavour = SYNC
