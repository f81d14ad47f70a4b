"""What a pack may declare, checked against the snapshot's own meta before a byte of it is extracted.

A manifest's sizes are its author's word, and zstd turns a few MiB of one repeated byte into a TiB,
so every declared size is held to what that file can be in a snapshot of this machine: the memory
file is exactly the guest RAM the manifest's identity records (``check_meta`` later holds every
layer's meta to that identity, and its boot RAM to it), a memory layer at most every page of that
RAM, the device state, kernel and initrd small, a disk layer at most its chain's base disk plus the
disk format's metadata. A file no snapshot holds is refused. The free space all of it needs is
checked after this (``space.py``); the reader then never decompresses more than was declared.
"""

from __future__ import annotations

from forkd.packs.format import META_NAME, Manifest, PackError, member_name
from forkd.store.layout import BASE_DISK_FILE, INITRD_FILE, KERNEL_FILE, LAYER_FILE, MEMORY_FILE, STATE_FILE
from forkd.vmm.base import PAGE_SIZE

MAX_META_BYTES = 1 << 20  # a snapshot's meta.json is read whole into memory: a few KiB in practice
MAX_STATE_BYTES = 256 << 20  # QEMU's device state without guest RAM (no VGA: -nodefaults): a few MiB
MAX_BOOT_FILE_BYTES = 512 << 20  # a kernel or an initrd
MAX_BASE_DISK_BYTES = 1 << 40  # an image's root disk: image builds allow up to 1 TiB
_LAYER_HEADER_BYTES = 64  # a memory layer's fixed header, generously (store/layers.py)


def disk_layer_bound(base_disk_bytes: int) -> int:
    """The most a disk layer over a base disk of ``base_disk_bytes`` holds: every cluster of it, plus
    the disk format's tables (a copy-on-write format's are well under 1/1000 of the disk; 1/64 and 64 MiB
    leave room)."""
    return base_disk_bytes + base_disk_bytes // 64 + (64 << 20)


def memory_layer_bound(memory_bytes: int) -> int:
    """A memory layer holding every page of the guest's RAM: the header, one offset and the data per page."""
    return _LAYER_HEADER_BYTES + (memory_bytes // PAGE_SIZE) * (8 + PAGE_SIZE)


def check_declared_sizes(manifest: Manifest, disk_file: str, store_base_disk_bytes: int | None) -> None:
    """Refuse (:class:`PackError`) a manifest declaring a file no snapshot of it can hold, or larger
    than that file can be. ``disk_file`` is the VMM backend's disk layer name; ``store_base_disk_bytes``
    the size of the base disk of the store's ancestors a pack whose root has a parent builds on."""
    memory_bytes = manifest.machine_identity().memory_mib << 20
    base_disks = [item.size for entry in manifest.snapshots for item in entry.files if item.name == BASE_DISK_FILE]
    if store_base_disk_bytes is not None:
        base_disks.append(store_base_disk_bytes)
    disk_bound = disk_layer_bound(max(base_disks, default=MAX_BASE_DISK_BYTES))
    bounds = {META_NAME: MAX_META_BYTES, STATE_FILE: MAX_STATE_BYTES, KERNEL_FILE: MAX_BOOT_FILE_BYTES,
              INITRD_FILE: MAX_BOOT_FILE_BYTES, BASE_DISK_FILE: MAX_BASE_DISK_BYTES, disk_file: disk_bound,
              LAYER_FILE: memory_layer_bound(memory_bytes)}
    for entry in manifest.snapshots:
        for item in entry.files:
            where = member_name(entry.tag, item.name)
            if item.name == MEMORY_FILE:
                if item.size != memory_bytes:
                    raise PackError(f"{where} is declared as {item.size} bytes, but the snapshot's guest RAM is "
                                    f"{manifest.machine_identity().memory_mib} MiB ({memory_bytes} bytes): "
                                    "the pack is inconsistent or crafted; refused before extracting anything")
                continue
            bound = bounds.get(item.name)
            if bound is None:
                raise PackError(f"{where} is not a file a forkd snapshot holds (expected "
                                f"{', '.join(sorted({*bounds, MEMORY_FILE}))}); refused")
            if item.size > bound:
                raise PackError(f"{where} is declared as {item.size} bytes, more than such a file can hold "
                                f"({bound} bytes); the pack is crafted or damaged; refused before extracting anything")
