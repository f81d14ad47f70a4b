"""Hand a stopped VMM's private memory to the kernel's reclaim: ``process_madvise(MADV_PAGEOUT)``.

A child stopped for being idle (runtime/idle.py) holds its private memory all the while: the TCG
translation buffer, QEMU's heap and arenas, the guest pages it wrote. ``MADV_PAGEOUT`` (Linux ≥ 5.4;
from another process with ``process_madvise``, Linux ≥ 5.10) reclaims the given pages now, as memory
pressure would later: anonymous pages go to swap, and fault back in when the VMM touches them again,
so its next request undoes it for free. Without swap, anonymous pages cannot be reclaimed and the
call does nothing useful: :func:`swap_bytes` says whether there is any.

Which pages: the VMM's private writable mappings (``/proc/PID/maps``, permissions ``rw?p``). An
anonymous one (heap, arenas, the translation buffer, stacks) is handed over whole. A file-backed one
(guest RAM mapped ``MAP_PRIVATE`` from the snapshot's memory file, libraries' data) holds two kinds of
page: the child's own copy-on-write copies (anonymous) and the file's page cache, shared with the
other children of the same snapshot. The kernel (mm/madvise.c, ``can_do_file_pageout``) would also
drop that page cache when the caller may write the file, which the daemon (root) always may, so such
a mapping is handed over only where its pages are anonymous (``vmm/procmem.private_runs``, from the
page map): the shared file pages stay where every child finds them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from forkd.vmm.procmem import ProcMemError, private_runs

MADV_PAGEOUT = 21  # include/uapi/asm-generic/mman-common.h
_SYSCALL = {"x86_64": 440, "aarch64": 440}  # process_madvise: the same number on both (asm-generic table)
IOV_MAX = 1024  # ranges one call takes
CALL_BYTES = 16 << 20  # at most this much per call, so a wake that comes meanwhile stops it soon
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class PageoutError(OSError):
    """The kernel refused to page out another process's memory (too old, no privilege, no such process)."""


@dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/PID/maps``."""

    start: int
    end: int
    perms: str
    inode: int
    path: str

    @property
    def private_writable(self) -> bool:
        return self.perms[1] == "w" and self.perms[3] == "p"

    @property
    def anonymous(self) -> bool:
        """Not backed by a file (the heap, stacks, ``mmap(MAP_ANONYMOUS)``): every page is the process's own."""
        return self.inode == 0


@dataclass(frozen=True)
class Pageout:
    """What one reclaim handed to the kernel: bytes advised, and whether it went through every range
    (False: stopped by the caller, the time bound, or the process's exit)."""

    advised: int
    complete: bool


def parse_maps(text: str) -> list[Mapping]:
    """The mappings of a ``/proc/PID/maps`` text."""
    mappings = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        start, _, end = fields[0].partition("-")
        mappings.append(Mapping(int(start, 16), int(end, 16), fields[1], int(fields[4]),
                                fields[5] if len(fields) > 5 else ""))
    return mappings


def ranges(pid: int, mappings: list[Mapping]) -> list[tuple[int, int]]:
    """``(start, end)`` of the process's own memory to page out: its private writable mappings, those
    backed by a file only where their pages are anonymous (see the module's doc)."""
    found: list[tuple[int, int]] = []
    for mapping in mappings:
        if not mapping.private_writable:
            continue
        if mapping.anonymous:
            found.append((mapping.start, mapping.end))
        else:
            found.extend((run.start, run.end) for run in private_runs(pid, mapping.start, mapping.end))
    return found


def swap_bytes(swaps: Path = Path("/proc/swaps")) -> int:
    """Swap space the host has (all active swap areas, zram or disk); 0: none."""
    total = 0
    for line in swaps.read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[2].isdigit():
            total += int(fields[2]) << 10
    return total


def page_out(pid: int, stop: Callable[[], bool], budget_s: float) -> Pageout:
    """Page out process ``pid``'s own memory (see the module's doc), in calls of at most ``CALL_BYTES``;
    stops early when ``stop()`` says so or after ``budget_s``. Runs for a while: not on an event loop."""
    deadline = time.monotonic() + budget_s
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return Pageout(0, False)
    try:
        try:
            todo = ranges(pid, parse_maps(Path(f"/proc/{pid}/maps").read_text()))
        except (OSError, ProcMemError):  # it exited meanwhile
            return Pageout(0, False)
        advised = 0
        for batch in _batches(todo):
            if stop() or time.monotonic() > deadline:
                return Pageout(advised, False)
            done, gone = _advise(pidfd, batch)
            advised += done
            if gone:
                return Pageout(advised, False)
        return Pageout(advised, True)
    finally:
        os.close(pidfd)


def _batches(todo: list[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
    """The ranges cut into calls of at most ``IOV_MAX`` ranges and ``CALL_BYTES`` bytes."""
    batch: list[tuple[int, int]] = []
    size = 0
    for start, end in todo:
        while start < end:
            piece = min(end - start, CALL_BYTES - size)
            batch.append((start, piece))
            size += piece
            start += piece
            if size >= CALL_BYTES or len(batch) >= IOV_MAX:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _advise(pidfd: int, batch: list[tuple[int, int]]) -> tuple[int, bool]:
    """One batch: (bytes advised, whether the process is gone). A range the kernel refuses (unmapped
    since the maps were read, locked, a huge-page mapping) is skipped and the call goes on after it."""
    advised = 0
    while batch:
        iov = (_IoVec * len(batch))(*(_IoVec(start, length) for start, length in batch))
        got = _libc.syscall(_syscall_number(), pidfd, iov, len(batch), MADV_PAGEOUT, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.ESRCH:
                return advised, True
            if err in (errno.ENOSYS, errno.EPERM, errno.EBADF):
                raise PageoutError(err, f"process_madvise(MADV_PAGEOUT) failed: {os.strerror(err)}; it needs "
                                        "Linux ≥ 5.10 and CAP_SYS_NICE over the VMM (a root daemon has both)")
            got = 0  # the first range failed: skip it
        # the call stops at the first range it cannot advise and answers what it did before it
        through = 0
        for i, (_, length) in enumerate(batch):
            if through + length > got:
                advised += through
                batch = batch[i + 1:]
                break
            through += length
        else:
            return advised + through, False
    return advised, False


def _syscall_number() -> int:
    machine = platform.machine()
    if machine not in _SYSCALL:
        raise PageoutError(errno.ENOSYS, f"process_madvise: unknown system call number on {machine}")
    return _SYSCALL[machine]
