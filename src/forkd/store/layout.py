"""What a snapshot directory holds, by name, and the version of that layout.

The disk layer's name is the VMM backend's (``forkd.vmm.disk.DiskFormat.file_name``), handed to
the store: nothing here knows a disk format.

``meta.json`` records ``format``: a daemon refuses a snapshot written in a newer format than it
reads (a snapshot without the field predates the field and has format 1's layout).
"""

from __future__ import annotations

from typing import Any

FORMAT_VERSION = 1
KERNEL_FILE, INITRD_FILE, BASE_DISK_FILE = "vmlinuz", "initrd.img", "base.ext4"
MEMORY_FILE, LAYER_FILE = "memory", "memory.layer"
STATE_FILE, META_FILE = "state", "meta.json"
BUILD_PREFIX = ".build-"  # snapshots/.build-LABEL-*: work directories, renamed into place or removed
OLDER_WORK_PREFIXES = (".unpack-", ".pull-", ".push-")  # what daemons before the store named theirs
#: What a branch or a compacted snapshot takes over from the meta of the snapshot it came from:
#: the machine its state belongs to and how that state was warmed.
INHERITED_META = ("identity", "boot", "image_key", "warm_modules", "warm_code", "warmup_cmd")


def baked_files(disk_file: str) -> tuple[str, ...]:
    """The files of a baked (or compacted) snapshot; a branch holds the kernel, initrd, disk layer,
    state and its memory file (see :func:`branch_files`)."""
    return (KERNEL_FILE, INITRD_FILE, BASE_DISK_FILE, disk_file, MEMORY_FILE, STATE_FILE)


def branch_files(disk_file: str, meta: dict[str, Any]) -> tuple[str, ...]:
    """The files of a branch, whose own memory is a whole file or a layer (see ``meta``)."""
    return (KERNEL_FILE, INITRD_FILE, disk_file, STATE_FILE, memory_layer_name(meta))


def memory_layer_name(meta: dict[str, Any]) -> str:
    """The file holding a snapshot's own memory: the whole of it, or only its changed pages."""
    return LAYER_FILE if meta.get("memory_kind") == "diff" else MEMORY_FILE


def snapshot_format(meta: dict[str, Any]) -> int:
    return int(meta.get("format", 1))
