"""File primitives the store relies on: content digests computed once, atomic writes, cheap links."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

_CHUNK = 4 * 1024 * 1024
Version = tuple[int, int, int, int, int]  # (device, inode, size, mtime, ctime): see DigestCache


def file_version(path: Path) -> Version:
    """What identifies one version of a file's bytes (see :class:`DigestCache`)."""
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class DigestCache:
    """SHA-256 of files, remembered per file version so a gigabyte is hashed once, not per spawn.

    A version is (device, inode, size, mtime, ctime). Writing a file changes its mtime and ctime;
    resetting the mtime (``touch -d``) changes the ctime, which no caller can set. So a file whose
    stat still matches the version that was hashed holds the bytes that were hashed, and any other
    file is hashed again. A digest is cached only if the file's version did not change while it was read.
    """

    def __init__(self) -> None:
        self._known: dict[tuple[int, int, int, int, int], str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _version(path: Path) -> Version:
        return file_version(path)

    def remember(self, path: Path, digest: str) -> None:
        """Record ``digest``, computed by the caller over the bytes it just wrote, for the file as it is now."""
        with self._lock:
            self._known[self._version(path)] = digest

    def chmod(self, path: Path, mode: int) -> None:
        """Change ``path``'s mode, keeping the digest known for it: a chmod changes the ctime, not the bytes."""
        before = self._version(path)
        os.chmod(path, mode)
        self._carry(before, path)

    def link(self, src: Path, dst: Path) -> None:
        """:func:`link_or_copy` ``src`` to ``dst``, keeping the digest known for it: a new link changes the
        shared inode's ctime, not its bytes, so a snapshot's kernel is not hashed again per branch."""
        before = self._version(src)
        link_or_copy(src, dst)
        self._carry(before, dst)

    def _carry(self, before: tuple[int, int, int, int, int], path: Path) -> None:
        """The digest known for version ``before``, remembered for ``path`` now if only its ctime moved:
        the same inode (device, number), size and mtime (a write in between would have set it)."""
        after = self._version(path)
        with self._lock:
            digest = self._known.get(before)
            if digest is not None and after[:4] == before[:4]:
                self._known[after] = digest

    def sha256(self, path: Path) -> str:
        version = self._version(path)
        with self._lock:
            cached = self._known.get(version)
        if cached is not None:
            return cached
        digest = sha256_file(path)
        if self._version(path) == version:  # not written while it was read: this digest is of that version
            with self._lock:
                self._known[version] = digest
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


def fsync_tree(directory: Path) -> None:
    """Flush every file directly in ``directory``, then the directory itself, to stable storage."""
    for entry in directory.iterdir():
        if entry.is_file() and not entry.is_symlink():
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def renameat2(source: Path, target: Path, flags: int) -> None:
    """Linux ``renameat2``: ``RENAME_NOREPLACE`` fails with EEXIST instead of replacing ``target``,
    ``RENAME_EXCHANGE`` swaps the two entries; either way in one atomic step."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(source), None, str(target))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
