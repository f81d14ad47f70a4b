"""Private (copy-on-write) pages of a file mapping, found through the page map and copied out.

These run against this test process's own mapping: a real kernel, a real MAP_PRIVATE file mapping.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.vmm import guest_ram, procmem

PAGES = 64
PAGE = procmem.PAGE_SIZE


@pytest.fixture
def mapping(tmp_path: Path) -> Iterator[tuple[mmap.mmap, int]]:
    """A file of PAGES distinct pages mapped MAP_PRIVATE and read through (all file-backed)."""
    path = tmp_path / "memory"
    path.write_bytes(b"".join(bytes([i]) * PAGE for i in range(PAGES)))
    with open(path, "r+b") as f:
        area = mmap.mmap(f.fileno(), PAGES * PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    assert area[:] == path.read_bytes()  # every page faulted in as a file page
    yield area, base
    area.close()


def pages(runs: list[procmem.Run], base: int) -> list[tuple[int, int]]:
    return [((r.start - base) // PAGE, (r.end - base) // PAGE) for r in runs]


@pytest.mark.parametrize("scan", [True, False], ids=["pagemap_scan", "pagemap_read"])
def test_written_pages_are_the_private_runs(mapping: tuple[mmap.mmap, int], monkeypatch: pytest.MonkeyPatch,
                                            scan: bool) -> None:
    area, base = mapping
    if scan and not procmem._scan_supported():
        pytest.skip("this kernel has no PAGEMAP_SCAN")
    monkeypatch.setattr(procmem, "_scan_supported", lambda: scan)
    assert procmem.private_runs(os.getpid(), base, base + PAGES * PAGE) == []
    for page in (3, 4, 5, 10, PAGES - 1):
        area[page * PAGE] = 0xFF
    runs = procmem.private_runs(os.getpid(), base, base + PAGES * PAGE)
    assert pages(runs, base) == [(3, 6), (10, 11), (PAGES - 1, PAGES)]
    # A window inside the mapping sees only its part.
    assert pages(procmem.private_runs(os.getpid(), base + 4 * PAGE, base + 11 * PAGE), base) == [(4, 6), (10, 11)]


def test_copy_runs_reads_the_private_copies(mapping: tuple[mmap.mmap, int]) -> None:
    area, base = mapping
    area[3 * PAGE + 1] = 0xAA
    area[9 * PAGE + 2] = 0xBB
    runs = procmem.private_runs(os.getpid(), base, base + PAGES * PAGE)
    buffer = mmap.mmap(-1, 3 * PAGE)
    spans = [(run.start, run.length, PAGE * (i + 1)) for i, run in enumerate(runs)]
    assert procmem.copy(os.getpid(), spans, buffer) == 2 * PAGE
    assert buffer[:PAGE] == bytes(PAGE)
    assert buffer[PAGE:2 * PAGE] == area[3 * PAGE:4 * PAGE] and buffer[PAGE + 1] == 0xAA
    assert buffer[2 * PAGE:] == area[9 * PAGE:10 * PAGE] and buffer[2 * PAGE + 2] == 0xBB


def test_merge_joins_adjacent_runs_of_one_kind() -> None:
    runs = [procmem.Run(0, 4096, False), procmem.Run(4096, 8192, False), procmem.Run(8192, 12288, True),
            procmem.Run(16384, 20480, True)]
    assert procmem._merge(runs) == [procmem.Run(0, 8192, False), procmem.Run(8192, 12288, True),
                                    procmem.Run(16384, 20480, True)]


def test_a_gone_process_is_a_clear_error() -> None:
    with pytest.raises(procmem.ProcMemError, match="page map of process"):
        procmem.private_runs(2**22 + 1, 0, PAGE)


def test_soft_dirty_probe_answers() -> None:
    assert procmem.soft_dirty_supported() in (True, False)


def test_read_private_copies_changed_pages_and_reuses_a_clean_precopy(mapping: tuple[mmap.mmap, int],
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    area, _ = mapping
    memory, size = tmp_path / "memory", PAGES * PAGE
    area[2 * PAGE] = 0xA1
    area[7 * PAGE] = 0xA2
    first = guest_ram.read_private(os.getpid(), memory, size)
    assert list(first.offsets) == [2 * PAGE, 7 * PAGE]
    assert bytes(first.data[:PAGE]) == area[2 * PAGE:3 * PAGE]
    # Page 2 is rewritten, page 9 written for the first time. Say the kernel marked page 9's run
    # soft-dirty and not page 2's: clean runs come from the pre-copy, dirty ones are read again.
    area[2 * PAGE] = 0xB1
    area[9 * PAGE] = 0xB2
    scanned = procmem.private_runs

    def marked(pid: int, start: int, end: int) -> list[procmem.Run]:
        return [procmem.Run(r.start, r.end, r.start - start >= 9 * PAGE) for r in scanned(pid, start, end)]

    monkeypatch.setattr(procmem, "private_runs", marked)
    second = guest_ram.read_private(os.getpid(), memory, size, previous=first)
    assert list(second.offsets) == [2 * PAGE, 7 * PAGE, 9 * PAGE]
    assert second.data[0] == 0xA1  # from the pre-copy: not marked, so not read again
    assert second.data[2 * PAGE] == 0xB2


def test_read_private_fills_a_prepared_buffer_or_maps_one_when_the_guest_wrote_more(
        mapping: tuple[mmap.mmap, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    area, _ = mapping
    memory, size = tmp_path / "memory", PAGES * PAGE
    area[1 * PAGE] = 0xC1
    monkeypatch.setattr(guest_ram, "PREPARE_MARGIN", PAGE)
    prepared = guest_ram.prepare_read(os.getpid(), memory, size)
    assert len(prepared) == 2 * PAGE  # one private page now, and the margin
    marks: list[str] = []
    area[5 * PAGE] = 0xC5
    pages = guest_ram.read_private(os.getpid(), memory, size, into=prepared, mark=marks.append)
    assert marks == ["pages_scanned"] and list(pages.offsets) == [1 * PAGE, 5 * PAGE]
    assert (pages.data[0], pages.data[PAGE]) == (0xC1, 0xC5) and pages.data.obj is prepared
    # Written after the buffer was prepared, beyond its margin: the copy is still whole.
    small = guest_ram.prepare_read(os.getpid(), memory, size)
    for page in (20, 30, 40):
        area[page * PAGE] = page
    pages = guest_ram.read_private(os.getpid(), memory, size, into=small)
    assert list(pages.offsets) == [p * PAGE for p in (1, 5, 20, 30, 40)] and small.closed
    assert [pages.data[i * PAGE] for i in range(5)] == [0xC1, 0xC5, 20, 30, 40]
