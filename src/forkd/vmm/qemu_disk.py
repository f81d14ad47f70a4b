"""QEMU's disk format: qcow2 layers over the raw base image, made and changed with ``qemu-img``.

The :class:`forkd.vmm.disk.DiskFormat` of :class:`forkd.vmm.qemu.QemuVmm`. A snapshot's layer is
``disk.qcow2`` (the name every QEMU snapshot on disk and in a pack has had); a baked one is backed
by ``base.ext4`` (raw) next to it, a branch's by ``../<parent tag>/disk.qcow2`` (qcow2). A VM's
own disk is a qcow2 overlay in its run directory.

A qcow2 header can name any host path as its backing file or external data file, and a backing
format QEMU would follow further (a vmdk descriptor can point at a block device), so a qcow2 file
arriving in a pack is read here before QEMU ever opens it (:meth:`QemuDisk.check_packed`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from forkd.vmm.base import VmmError
from forkd.vmm.disk import UnsafeDisk, require_in_chain

DISK_FILE = "disk.qcow2"
#: An empty overlay over a snapshot's layer, kept next to it: each child's disk is a copy of it.
CHILD_OVERLAY_TEMPLATE = "child-overlay.qcow2"
QEMU_IMG_TIMEOUT_S = 120.0
#: More layers than a disk is read through in practice (each BRANCH adds one); a loop of backing names stops here.
MAX_BACKING_CHAIN = 1024

MAGIC = b"QFI\xfb"
_EXT_END, _EXT_BACKING_FORMAT = 0, 0xE2792ACA
_INCOMPAT_DATA_FILE = 1 << 2
ALLOWED_BACKING_FORMATS = ("raw", "qcow2")
_HEADER_READ = 64 * 1024


class QemuDisk:
    """qcow2 layers (see the module docstring)."""

    file_name = DISK_FILE

    def __init__(self) -> None:
        self._template_lock = asyncio.Lock()

    async def new_root(self, base: Path, disk: Path) -> None:
        await create_overlay(base, disk, "raw", relative=base.parent.resolve() == disk.parent.resolve())

    async def new_child(self, layer: Path, disk: Path) -> None:
        """A copy of an empty overlay over ``layer`` made once: copying ~200 KB is far cheaper than
        running qemu-img for every child of a batch."""
        template = layer.with_name(CHILD_OVERLAY_TEMPLATE)
        async with self._template_lock:
            if not template.exists():
                partial = template.with_name(f".{template.name}.partial")
                await create_overlay(layer, partial, "qcow2")
                os.replace(partial, template)
        await asyncio.to_thread(shutil.copyfile, template, disk)

    async def export_layer(self, frozen: Path, dest: Path, backing_name: str | None) -> None:
        """The source still reads ``frozen`` as a backing file (QEMU holds a lock on it): the snapshot
        gets its own copy, which holds only what the source wrote since its last branch, pointed at
        its parent's disk by relative name; without one it takes in the source's earlier layers instead."""
        await asyncio.to_thread(shutil.copyfile, frozen, dest)
        if backing_name is not None:
            await rebase(dest, backing_name, "qcow2", unsafe=True)
        else:
            await _merge_own_layers(frozen, dest)

    async def flatten(self, disk: Path, base_name: str) -> None:
        await rebase(disk, base_name, "raw", unsafe=False)

    def check_packed(self, path: Path, own_files: set[str], ancestors: Mapping[str, set[str]]) -> None:
        """Any qcow2 file: backed only by a file of its chain, as raw or qcow2, without an external data file."""
        if not is_qcow2(path):
            return  # QEMU opens it raw, or (a snapshot's disk) refuses it as not qcow2
        backing, backing_format = backing_reference(path)
        if backing is None:
            return
        require_in_chain(path, backing, own_files, ancestors)
        if backing_format not in ALLOWED_BACKING_FORMATS:
            raise UnsafeDisk(f"{path.parent.name}/{path.name} declares backing format {backing_format!r}; "
                             f"only {' or '.join(ALLOWED_BACKING_FORMATS)} are accepted")


# qemu-img ------------------------------------------------------------------------------------------

async def qemu_img(*args: str, timeout_s: float = QEMU_IMG_TIMEOUT_S) -> None:
    try:
        proc = await asyncio.create_subprocess_exec("qemu-img", *args, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.PIPE)
    except OSError as exc:
        raise VmmError(f"qemu-img failed ({exc!r}); install qemu-utils with `bash scripts/setup`") from None
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise VmmError(f"qemu-img {args[0]} did not finish in {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise VmmError(f"qemu-img {' '.join(args)}: {stderr.decode(errors='replace').strip()}")


async def create_overlay(backing: Path, overlay: Path, backing_format: str, relative: bool = False) -> None:
    """A qcow2 overlay so the VM writes its own file and ``backing`` stays untouched.

    ``relative`` records the backing file by name only, resolved next to the overlay, so a
    directory holding both can be renamed into place after it is built.
    """
    if relative and backing.parent.resolve() != overlay.parent.resolve():
        raise VmmError(f"relative backing file {backing} must sit next to {overlay}")
    backing_ref = backing.name if relative else str(backing)
    await qemu_img("create", "-q", "-f", "qcow2", "-b", backing_ref, "-F", backing_format, str(overlay))


async def rebase(disk: Path, backing_name: str, backing_format: str, unsafe: bool) -> None:
    """Point ``disk`` at another backing file; ``unsafe=False`` first copies in what the two differ in."""
    await qemu_img("rebase", *(["-u"] if unsafe else []), "-f", "qcow2", "-b", backing_name,
                   "-F", backing_format, str(disk))


async def _merge_own_layers(frozen: Path, dest: Path) -> None:
    """``dest`` (a copy of ``frozen``) takes in the layers below ``frozen`` in the VM's run directory (the
    tops of its earlier BRANCHes, which no snapshot may hold any more) and then lies over the first layer
    outside it: the disk of the snapshot the VM was started from. qemu-img cannot open those layers beside
    the QEMU that keeps them locked for writing, so it reads copies of them."""
    chain = await asyncio.to_thread(backing_chain, frozen)
    run_dir = frozen.parent.resolve()
    own = list(itertools.takewhile(lambda layer: layer.parent.resolve() == run_dir, chain))
    if len(own) == len(chain):
        raise VmmError(f"{frozen} lies over no disk outside its run directory; nothing to lay its layers over")
    below = chain[len(own)]
    _, below_format = await asyncio.to_thread(backing_reference, own[-1] if own else frozen)
    scratch = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=".own-layers-", dir=dest.parent))
    try:  # the copies may hold gigabytes: copied and removed off the event loop
        copies = [scratch / f"{n}.qcow2" for n in range(len(own))]
        for layer, copy in zip(own, copies):
            await asyncio.to_thread(shutil.copyfile, layer, copy)
        for upper, lower in zip([dest, *copies], copies):
            await rebase(upper, str(lower), "qcow2", unsafe=True)
        if copies:
            await rebase(copies[-1], str(below), below_format or "qcow2", unsafe=True)
        await rebase(dest, str(below), below_format or "qcow2", unsafe=not copies)
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, ignore_errors=True)


def backing_chain(disk: Path) -> list[Path]:
    """The files QEMU opens by name through ``disk``: its backing file, that one's, and so on, named as QEMU
    names them (a relative name is taken next to the file that records it). A jailed QEMU sees only these."""
    chain: list[Path] = []
    current = disk
    while is_qcow2(current):
        backing, _ = backing_reference(current)
        if backing is None:
            return chain
        if len(chain) == MAX_BACKING_CHAIN:
            raise VmmError(f"{disk} is read through more than {MAX_BACKING_CHAIN} backing files; flatten it")
        current = Path(os.path.normpath(current.parent / backing))
        chain.append(current)
    return chain


# qcow2 headers -------------------------------------------------------------------------------------

def is_qcow2(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def backing_reference(path: Path) -> tuple[str | None, str | None]:
    """``(backing file name, backing format)`` recorded in a qcow2 header; refuses an external data file."""
    with open(path, "rb") as f:
        head = f.read(_HEADER_READ)
        if len(head) < 72 or head[:4] != MAGIC:
            raise UnsafeDisk(f"{path.name} is not a qcow2 image")
        version, backing_offset, backing_size = struct.unpack_from(">IQI", head, 4)
        if version not in (2, 3):
            raise UnsafeDisk(f"{path.name}: qcow2 version {version} is not supported")
        header_length = 72
        if version == 3:
            if len(head) < 104:
                raise UnsafeDisk(f"{path.name}: truncated qcow2 header")
            (incompatible,) = struct.unpack_from(">Q", head, 72)
            if incompatible & _INCOMPAT_DATA_FILE:
                raise UnsafeDisk(f"{path.name} keeps its data in an external file; packs may not reference host files")
            (header_length,) = struct.unpack_from(">I", head, 100)
        backing = None
        if backing_offset:
            if not 0 < backing_size <= 1023:
                raise UnsafeDisk(f"{path.name}: backing file name of {backing_size} bytes")
            f.seek(backing_offset)
            raw = f.read(backing_size)
            try:
                backing = raw.decode()
            except UnicodeDecodeError:
                raise UnsafeDisk(f"{path.name}: backing file name is not UTF-8") from None
    return backing, _backing_format(path.name, head, header_length) if backing else None


def _backing_format(name: str, head: bytes, offset: int) -> str | None:
    while offset + 8 <= len(head):
        kind, length = struct.unpack_from(">II", head, offset)
        if kind == _EXT_END:
            return None
        data = head[offset + 8: offset + 8 + length]
        if len(data) != length:
            raise UnsafeDisk(f"{name}: truncated qcow2 header extension")
        if kind == _EXT_BACKING_FORMAT:
            return data.decode(errors="replace")
        offset += 8 + (length + 7) // 8 * 8
    raise UnsafeDisk(f"{name}: qcow2 header extensions run past the first {_HEADER_READ} bytes")
