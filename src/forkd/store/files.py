"""File primitives the store relies on: content digests computed once, atomic writes, cheap links."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

_CHUNK = 4 * 1024 * 1024


class DigestCache:
    """SHA-256 of files, remembered per (inode, size, mtime) so a base is hashed once, not per spawn."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int, int, int, int], str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(path: Path) -> tuple[str, int, int, int, int]:
        st = path.stat()
        return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def remember(self, path: Path, digest: str) -> None:
        """Record a digest just computed by the caller for the file as it is now."""
        with self._lock:
            self._known[self._key(path)] = digest

    def sha256(self, path: Path) -> str:
        key = self._key(path)
        with self._lock:
            cached = self._known.get(key)
        if cached is not None:
            return cached
        digest = sha256_file(path)
        with self._lock:
            self._known[key] = digest
        return digest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (free, and immune to the source being replaced); copy across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
