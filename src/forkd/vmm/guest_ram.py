"""A VMM's guest RAM seen from the host: diff pages laid in before a restore, private pages read out.

Any VMM that maps the base memory file ``MAP_PRIVATE`` works with this: pages written through
``/proc/<pid>/mem`` become that process's private copy-on-write pages, exactly as in the source;
and the pages a guest wrote are exactly that process's private pages of the mapping, found in its
page map (:mod:`forkd.vmm.procmem`), so a BRANCH reads them without the VMM streaming anything.
"""

from __future__ import annotations

import mmap
import os
from array import array
from collections.abc import Callable
from pathlib import Path

from forkd.vmm import procmem
from forkd.vmm.base import PageLayer, Pages, VmmError

PAGE = procmem.PAGE_SIZE


def memory_mapping(pid: int, memory: Path, size: int) -> int:
    """Start address of the mapping of ``memory`` in process ``pid``."""
    wanted = str(memory.resolve())
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == wanted:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if end - start == size and int(fields[2], 16) == 0:
                    return start
    raise VmmError(f"guest RAM mapping of {memory} not found in process {pid}")


def write_layers(pid: int, memory: Path, size: int, layers: list[PageLayer]) -> int:
    """Lay each layer's pages (base first) over the guest RAM of process ``pid``; bytes written."""
    address = memory_mapping(pid, memory, size)
    written = 0
    mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        for layer in layers:
            src = os.open(layer.path, os.O_RDONLY)
            try:
                for guest_offset, position, length in layer.runs():
                    if guest_offset + length > size:
                        raise VmmError(f"layer {layer.path} holds a page beyond guest RAM ({guest_offset:#x})")
                    data = os.pread(src, length, position)
                    if len(data) != length or os.pwrite(mem, data, address + guest_offset) != length:
                        raise VmmError(f"could not lay {layer.path} over the RAM of process {pid}")
                    written += length
            finally:
                os.close(src)
    finally:
        os.close(mem)
    return written


PREPARE_MARGIN = 8 << 20  # at least this much more than the pages private before the stop


def prepare_read(pid: int, memory: Path, size: int) -> mmap.mmap:
    """A destination for :func:`read_private`, mapped and faulted in while the guest still runs.

    Copying into fresh anonymous memory faults in every destination page during the copy, which
    costs more than the copy itself; so a BRANCH takes the buffer before it stops the guest, sized
    by the pages private now plus a margin for what the guest writes until the stop (a buffer that
    turns out too small is not used: :func:`read_private` then maps one of the size it needs).
    """
    address = memory_mapping(pid, memory, size)
    total = sum(run.length for run in _private_runs(pid, address, size))
    return procmem.prefaulted(total + max(total // 8, PREPARE_MARGIN))


def read_private(pid: int, memory: Path, size: int, previous: Pages | None = None, into: mmap.mmap | None = None,
                 mark: Callable[[str], None] | None = None) -> Pages:
    """The guest RAM pages process ``pid`` holds privately over ``memory``, copied out.

    ``into``: a buffer from :func:`prepare_read`, used if the pages fit (else closed). ``mark``
    is told ``pages_scanned`` when the page map was read; the copy follows.

    With ``previous`` (a copy taken while the guest ran, after the soft-dirty bits were cleared),
    only runs written since are read again: a page becomes private only by being written, which
    marks it soft-dirty, so a clean private page is the one ``previous`` holds.
    """
    address = memory_mapping(pid, memory, size)
    runs = _private_runs(pid, address, size)
    if mark is not None:
        mark("pages_scanned")
    total = sum(run.length for run in runs)
    if into is not None and len(into) >= total:
        area = into
    else:
        if into is not None:
            into.close()
        area = mmap.mmap(-1, max(total, PAGE))
    data = memoryview(area)
    known = {} if previous is None else {o: i for i, o in enumerate(previous.offsets)}
    fresh: list[tuple[int, int, int]] = []  # (address, length, position in data) to read from the VMM
    pos = 0
    for run in runs:
        if previous is not None and not run.soft_dirty and all(
                page in known for page in range(run.start - address, run.end - address, PAGE)):
            for i, page in enumerate(range(run.start - address, run.end - address, PAGE)):
                at = known[page] * PAGE
                data[pos + i * PAGE:pos + (i + 1) * PAGE] = previous.data[at:at + PAGE]
        else:
            fresh.append((run.start, run.length, pos))
        pos += run.length
    try:
        procmem.copy(pid, fresh, area)
    except OSError as exc:
        raise VmmError(f"cannot read the guest RAM of VMM process {pid}: {exc}") from None
    offsets = array("Q")
    for run in runs:
        offsets.extend(range(run.start - address, run.end - address, PAGE))
    return Pages(offsets=offsets, data=data[:total])


def _private_runs(pid: int, address: int, size: int) -> list[procmem.Run]:
    try:
        return procmem.private_runs(pid, address, address + size)
    except OSError as exc:
        raise VmmError(f"cannot read the page map of VMM process {pid}: {exc}") from None
