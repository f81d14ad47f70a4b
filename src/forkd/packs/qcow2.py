"""Checking the backing references of qcow2 files that arrive in a pack, before QEMU ever opens them.

A qcow2 header can name any host path as its backing file or external data file, and a backing
format QEMU would follow further (a vmdk descriptor can point at a block device). A disk from a
pack may only be backed by a file of its own snapshot (``base.ext4``) or of an ancestor in its
chain (``../<parent tag>/disk.qcow2``), as raw or qcow2, and may not use an external data file.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path

from forkd.packs.format import PackError

MAGIC = b"QFI\xfb"
_EXT_END, _EXT_BACKING_FORMAT = 0, 0xE2792ACA
_INCOMPAT_DATA_FILE = 1 << 2
ALLOWED_BACKING_FORMATS = ("raw", "qcow2")
_HEADER_READ = 64 * 1024


def is_qcow2(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def backing_reference(path: Path) -> tuple[str | None, str | None]:
    """``(backing file name, backing format)`` recorded in a qcow2 header; refuses an external data file."""
    with open(path, "rb") as f:
        head = f.read(_HEADER_READ)
        if len(head) < 72 or head[:4] != MAGIC:
            raise PackError(f"{path.name} is not a qcow2 image")
        version, backing_offset, backing_size = struct.unpack_from(">IQI", head, 4)
        if version not in (2, 3):
            raise PackError(f"{path.name}: qcow2 version {version} is not supported")
        header_length = 72
        if version == 3:
            if len(head) < 104:
                raise PackError(f"{path.name}: truncated qcow2 header")
            (incompatible,) = struct.unpack_from(">Q", head, 72)
            if incompatible & _INCOMPAT_DATA_FILE:
                raise PackError(f"{path.name} keeps its data in an external file; packs may not reference host files")
            (header_length,) = struct.unpack_from(">I", head, 100)
        backing = None
        if backing_offset:
            if not 0 < backing_size <= 1023:
                raise PackError(f"{path.name}: backing file name of {backing_size} bytes")
            f.seek(backing_offset)
            raw = f.read(backing_size)
            try:
                backing = raw.decode()
            except UnicodeDecodeError:
                raise PackError(f"{path.name}: backing file name is not UTF-8") from None
    return backing, _backing_format(path.name, head, header_length) if backing else None


def _backing_format(name: str, head: bytes, offset: int) -> str | None:
    while offset + 8 <= len(head):
        kind, length = struct.unpack_from(">II", head, offset)
        if kind == _EXT_END:
            return None
        data = head[offset + 8: offset + 8 + length]
        if len(data) != length:
            raise PackError(f"{name}: truncated qcow2 header extension")
        if kind == _EXT_BACKING_FORMAT:
            return data.decode(errors="replace")
        offset += 8 + (length + 7) // 8 * 8
    raise PackError(f"{name}: qcow2 header extensions run past the first {_HEADER_READ} bytes")


def check_backing(path: Path, own_files: set[str], ancestors: Mapping[str, set[str]]) -> None:
    """Refuse a qcow2 file whose backing reference leaves its snapshot and its chain's ancestors."""
    backing, backing_format = backing_reference(path)
    if backing is None:
        return
    parts = backing.split("/")
    allowed = (len(parts) == 1 and parts[0] in own_files) or (
        len(parts) == 3 and parts[0] == ".." and parts[2] in ancestors.get(parts[1], set()))
    if not allowed:
        raise PackError(f"{path.parent.name}/{path.name} is backed by {backing!r}: a disk in a pack may only be backed "
                        "by a file of its own snapshot or '../<ancestor tag>/<file>' of its chain")
    if backing_format not in ALLOWED_BACKING_FORMATS:
        raise PackError(f"{path.parent.name}/{path.name} declares backing format {backing_format!r}; "
                        f"only {' or '.join(ALLOWED_BACKING_FORMATS)} are accepted")
