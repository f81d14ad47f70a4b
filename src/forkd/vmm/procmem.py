"""Another process's own pages of a file mapping: find them in ``/proc/PID/pagemap``, copy them out.

A VMM that maps a memory file ``MAP_PRIVATE`` shares every page with the file until it writes one;
the kernel then gives it a private anonymous copy. Those pages (present or swapped, not file-backed)
are exactly what that VM changed, so reading them is enough to save its memory: no VMM involved.

The kernel's ``PAGEMAP_SCAN`` ioctl (Linux ≥ 6.7) returns them as runs in one call; older kernels
are read entry by entry (8 bytes per page). Pages are copied with ``process_vm_readv``. Soft-dirty bits (pagemap bit 55, cleared by writing 4
to ``/proc/PID/clear_refs``) tell which pages were written since the last clear, when the kernel
is built with ``CONFIG_MEM_SOFT_DIRTY``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

# pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst)
_PM_SOFT_DIRTY = 1 << 55
_PM_FILE = 1 << 61
_PM_SWAPPED = 1 << 62
_PM_PRESENT = 1 << 63

# PAGEMAP_SCAN (include/uapi/linux/fs.h)
_PAGE_IS_FILE = 1 << 2
_PAGE_IS_PRESENT = 1 << 3
_PAGE_IS_SWAPPED = 1 << 4
_PAGE_IS_SOFT_DIRTY = 1 << 7
_SCAN_REGIONS = 4096  # runs returned per ioctl call
_ENTRIES_PER_READ = 1 << 16  # pagemap fallback: 512 KiB of entries per read


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _ScanArg(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, ...)


class ProcMemError(OSError):
    """A process's page map or memory could not be read (it exited, or this kernel lacks a feature)."""


@dataclass(frozen=True)
class Run:
    """Adjacent private pages ``[start, end)`` (addresses in the process), written since the last
    soft-dirty clear or not."""

    start: int
    end: int
    soft_dirty: bool

    @property
    def length(self) -> int:
        return self.end - self.start


def private_runs(pid: int, start: int, end: int) -> list[Run]:
    """Runs of the process's private (copy-on-write, anonymous) pages in ``[start, end)``, ascending."""
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    except OSError as exc:
        raise ProcMemError(exc.errno, f"cannot read the page map of process {pid}: {exc.strerror}") from None
    try:
        if _scan_supported():
            return _merge(_scan(fd, start, end))
        return _merge(_read_entries(fd, start, end))
    finally:
        os.close(fd)


@cache
def _scan_supported() -> bool:
    """Whether this kernel has ``PAGEMAP_SCAN`` (asked once, on this process's own page map)."""
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        _scan_call(fd, 0, 0, (_PageRegion * 1)())
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        os.close(fd)


def _scan_call(fd: int, start: int, end: int, regions: ctypes.Array[_PageRegion]) -> tuple[int, int]:
    """One ``PAGEMAP_SCAN``: (regions filled, where the walk stopped)."""
    arg = _ScanArg(size=ctypes.sizeof(_ScanArg), start=start, end=end, vec=ctypes.addressof(regions),
                   vec_len=len(regions),
                   # match: not file-backed, and present or swapped
                   category_inverted=_PAGE_IS_FILE, category_mask=_PAGE_IS_FILE,
                   category_anyof_mask=_PAGE_IS_PRESENT | _PAGE_IS_SWAPPED,
                   return_mask=_PAGE_IS_SOFT_DIRTY | _PAGE_IS_PRESENT | _PAGE_IS_SWAPPED)
    count = fcntl.ioctl(fd, _PAGEMAP_SCAN, arg)
    return count, arg.walk_end


def _scan(fd: int, start: int, end: int) -> list[Run]:
    regions = (_PageRegion * _SCAN_REGIONS)()
    runs: list[Run] = []
    pos = start
    while pos < end:
        count, walk_end = _scan_call(fd, pos, end, regions)
        runs.extend(Run(r.start, r.end, bool(r.categories & _PAGE_IS_SOFT_DIRTY)) for r in regions[:count])
        if walk_end <= pos:
            raise ProcMemError(errno.EIO, f"PAGEMAP_SCAN made no progress at {pos:#x}")
        pos = walk_end
    return runs


def _read_entries(fd: int, start: int, end: int) -> list[Run]:
    runs: list[Run] = []
    address = start
    while address < end:
        count = min(_ENTRIES_PER_READ, (end - address) // PAGE_SIZE)
        raw = os.pread(fd, 8 * count, address // PAGE_SIZE * 8)
        if len(raw) != 8 * count:
            raise ProcMemError(errno.EIO, f"short read of the page map at {address:#x}")
        entries = array("Q")
        entries.frombytes(raw)
        for i, entry in enumerate(entries):
            if entry & (_PM_PRESENT | _PM_SWAPPED) and not entry & _PM_FILE:
                page = address + i * PAGE_SIZE
                runs.append(Run(page, page + PAGE_SIZE, bool(entry & _PM_SOFT_DIRTY)))
        address += count * PAGE_SIZE
    return runs


def _merge(runs: Iterable[Run]) -> list[Run]:
    """Adjacent runs with the same soft-dirty state as one (the kernel may split them per call)."""
    merged: list[Run] = []
    for run in runs:
        if merged and merged[-1].end == run.start and merged[-1].soft_dirty == run.soft_dirty:
            merged[-1] = Run(merged[-1].start, run.end, run.soft_dirty)
        else:
            merged.append(run)
    return merged


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = (ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong)


def copy(pid: int, spans: list[tuple[int, int, int]], into: mmap.mmap) -> int:
    """Copy ``(address, length, position in into)`` spans out of process ``pid``; bytes copied.

    ``process_vm_readv`` takes up to 1024 spans per call, so thousands of scattered pages cost a
    few system calls, not one each.
    """
    base = ctypes.addressof(ctypes.c_char.from_buffer(into))
    copied = 0
    for first in range(0, len(spans), _IOV_MAX):
        batch = spans[first:first + _IOV_MAX]
        local = (_IoVec * len(batch))(*((base + pos, length) for _, length, pos in batch))
        remote = (_IoVec * len(batch))(*((address, length) for address, length, _ in batch))
        wanted = sum(length for _, length, _ in batch)
        got = _libc.process_vm_readv(pid, local, len(batch), remote, len(batch), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise ProcMemError(err, f"cannot read the memory of process {pid}: {os.strerror(err)}")
        if got != wanted:
            raise ProcMemError(errno.EIO, f"short read of process {pid}: {got} of {wanted} bytes")
        copied += got
    return copied


def prefaulted(length: int) -> mmap.mmap:
    """Anonymous memory of ``length`` bytes with every page already faulted in (``MAP_POPULATE``), so
    a copy into it later costs only the copy."""
    return mmap.mmap(-1, max(length, PAGE_SIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)


def clear_soft_dirty(pid: int) -> None:
    """Start a new soft-dirty interval for process ``pid``: pages written from now on are marked."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("4")


@cache
def soft_dirty_supported() -> bool:
    """Whether this kernel tracks soft-dirty bits: a new mapping's pages read as soft-dirty if it does."""
    area = mmap.mmap(-1, PAGE_SIZE)
    try:
        area[0] = 1
        address = ctypes.addressof(ctypes.c_char.from_buffer(area))
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            entry = int.from_bytes(os.pread(fd, 8, address // PAGE_SIZE * 8), "little")
        finally:
            os.close(fd)
        return bool(entry & _PM_SOFT_DIRTY)
    finally:
        area.close()
