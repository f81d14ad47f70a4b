"""What a snapshot directory holds, by name, and the version of that layout.

``meta.json`` records ``format``: a daemon refuses a snapshot written in a newer format than it
reads (a snapshot without the field predates the field and has format 1's layout).
"""

from __future__ import annotations

from typing import Any

FORMAT_VERSION = 1
KERNEL_FILE, INITRD_FILE, BASE_DISK_FILE = "vmlinuz", "initrd.img", "base.ext4"
DISK_FILE, MEMORY_FILE, LAYER_FILE = "disk.qcow2", "memory", "memory.layer"
STATE_FILE, META_FILE = "state", "meta.json"
# The files of a baked (root) snapshot; a branch holds KERNEL, INITRD, DISK, STATE and its memory file.
HASHED_FILES = (KERNEL_FILE, INITRD_FILE, BASE_DISK_FILE, DISK_FILE, MEMORY_FILE, STATE_FILE)
BUILD_PREFIX = ".build-"  # snapshots/.build-LABEL-*: work directories, renamed into place or removed
OLDER_WORK_PREFIXES = (".unpack-", ".pull-", ".push-")  # what daemons before the store named theirs
#: What a branch or a compacted snapshot takes over from the meta of the snapshot it came from:
#: the machine its state belongs to and how that state was warmed.
INHERITED_META = ("identity", "boot", "image_key", "warm_modules", "warm_code", "warmup_cmd")


def memory_layer_name(meta: dict[str, Any]) -> str:
    """The file holding a snapshot's own memory: the whole of it, or only its changed pages."""
    return LAYER_FILE if meta.get("memory_kind") == "diff" else MEMORY_FILE


def snapshot_format(meta: dict[str, Any]) -> int:
    return int(meta.get("format", 1))
