"""Working inside a guest root tree on the host without ever stepping outside it.

A root taken from a user's directory or an OCI image holds symlinks meant for the guest, e.g.
``/etc/resolv.conf -> /run/systemd/resolve/stub-resolv.conf`` or ``/sbin -> usr/sbin``. Followed
naively on the host, an absolute link points into the host's own filesystem. Every path here is
resolved the way the guest will see it, with the tree as ``/``.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from forkd.image.errors import SourceError

_MAX_SYMLINKS = 40  # as the Linux kernel allows per lookup


def resolve_in_root(root: Path, path: str) -> Path:
    """Host path of guest path ``path``: symlinks followed with ``root`` as ``/``; ``..`` stops at ``root``."""
    pending = [p for p in reversed(path.split("/")) if p not in ("", ".")]
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        if not candidate.is_symlink():
            resolved.append(part)
            continue
        links += 1
        if links > _MAX_SYMLINKS:
            raise SourceError(f"too many levels of symlinks under {root} resolving {path}: fix the links in the tree")
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = []
        pending.extend(p for p in reversed(target.split("/")) if p not in ("", "."))
    return root.joinpath(*resolved)


def remove_entry(path: Path) -> None:
    """Remove a file, symlink or directory tree at ``path`` if there is one (links are not followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def write_in_root(root: Path, path: str, content: bytes, mode: int = 0o644) -> None:
    """Write guest file ``path``, replacing what is there: a symlink in its place is replaced, not followed."""
    parent_path = posixpath.dirname(path)
    ensure_dir_in_root(root, parent_path)
    parent = resolve_in_root(root, parent_path)
    target = parent / posixpath.basename(path)
    remove_entry(target)
    target.write_bytes(content)
    target.chmod(mode)


def ensure_dir_in_root(root: Path, path: str, mode: int = 0o755) -> None:
    """Make sure guest directory ``path`` exists; a new one gets ``mode``."""
    target = resolve_in_root(root, path)
    if target.is_dir():
        return
    remove_entry(target)
    parent = posixpath.dirname(path.rstrip("/"))
    if parent not in ("", "/"):
        ensure_dir_in_root(root, parent)  # each missing ancestor 0755, whatever the process umask
    target.mkdir()
    target.chmod(mode)


def tree_usage_bytes(root: Path) -> int:
    """Bytes allocated to the tree's files, each hard-linked inode counted once."""
    inodes = {(st.st_dev, st.st_ino): st.st_blocks * 512 for _, st in _entries(root)}
    return sum(inodes.values())


def tree_fingerprint(root: Path) -> str:
    """A digest of the tree's names, types, owners, modes, sizes, mtimes and link targets.

    Cheap (no file content is read) yet changes whenever anything in the tree is edited.
    """
    digest = hashlib.sha256()
    for rel, st in _entries(root):
        link = os.readlink(root / rel) if stat.S_ISLNK(st.st_mode) else ""
        digest.update(f"{rel}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0"
                      f"{st.st_mtime_ns}\0{link}\n".encode(errors="surrogateescape"))
    return digest.hexdigest()


def _entries(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below ``root`` (not following links) with its ``lstat``, in a stable order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            yield os.path.relpath(full, root), os.lstat(full)
