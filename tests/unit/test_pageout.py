"""Paging out a stopped VMM's own memory (vmm/pageout.py, runtime/reclaim.py), on a real process
standing for the VMM: which ranges are chosen from its /proc/PID/maps, how the calls are cut and go
past a range the kernel refuses, the host without swap, and (where a zram swap can be made) the pages
really leaving RAM and coming back intact."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import zram_swap
from forkd.runtime.reclaim import Reclaim
from forkd.vmm import pageout
from forkd.vmm.base import MemoryStats, VmHandle
from forkd.vmm.process import read_memory_stats

PAGE = 4096
ANON_MIB, FILE_MIB = 8, 4
WRITTEN_PAGES = (0, 5, 6, 700)  # pages of the private file mapping the process writes (copy on write)

# The stand-in VMM: an anonymous region (its heap and translation buffer), a private file mapping read
# whole and written at a few pages (guest RAM), a shared mapping written (never paged out: not its own).
VICTIM = f"""
import mmap, os, sys
anon = mmap.mmap(-1, {ANON_MIB} << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, len(anon), 4096): anon[i] = i // 4096 % 251 + 1
fd = os.open(sys.argv[1], os.O_RDWR)
ram = mmap.mmap(fd, {FILE_MIB} << 20, flags=mmap.MAP_PRIVATE)
sum(ram[i] for i in range(0, len(ram), 4096))
for page in {WRITTEN_PAGES}: ram[page * 4096] = 7
shared = mmap.mmap(fd, {FILE_MIB} << 20, flags=mmap.MAP_SHARED)
shared[0] = shared[0]
def at(m): import ctypes; return ctypes.addressof(ctypes.c_char.from_buffer(m))
print(at(anon), at(ram), at(shared), flush=True)
sys.stdin.read(1)
ok = all(anon[i] == i // 4096 % 251 + 1 for i in range(0, len(anon), 4096))
ok = ok and all(ram[p * 4096] == 7 for p in {WRITTEN_PAGES})
print("intact" if ok else "corrupt", flush=True)
"""


class Victim:
    def __init__(self, tmp_path: Path) -> None:
        memory = tmp_path / "memory"
        memory.write_bytes(bytes(range(256)) * (FILE_MIB << 12))
        self.process = subprocess.Popen([sys.executable, "-c", VICTIM, str(memory)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.anon, self.ram, self.shared = map(int, self.process.stdout.readline().split())
        self.pid = self.process.pid

    def intact(self) -> bool:
        """Whether every page the process wrote still holds what it wrote (it reads them all back)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("x")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip() == "intact"

    def maps(self) -> list[pageout.Mapping]:
        return pageout.parse_maps(Path(f"/proc/{self.pid}/maps").read_text())


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Victim]:
    process = Victim(tmp_path)
    yield process
    process.process.kill()
    process.process.wait(timeout=10)


def _covered(ranges: list[tuple[int, int]], start: int, end: int) -> int:
    return sum(max(0, min(e, end) - max(s, start)) for s, e in ranges)


def test_the_ranges_are_its_anonymous_memory_and_only_the_written_pages_of_a_private_file_mapping(
        victim: Victim) -> None:
    ranges = pageout.ranges(victim.pid, victim.maps())
    assert _covered(ranges, victim.anon, victim.anon + (ANON_MIB << 20)) == ANON_MIB << 20
    in_ram = sorted(page for start, end in ranges if victim.ram <= start < victim.ram + (FILE_MIB << 20)
                    for page in range(start, end, PAGE))
    assert in_ram == [victim.ram + page * PAGE for page in WRITTEN_PAGES]  # not the file's page cache
    assert _covered(ranges, victim.shared, victim.shared + (FILE_MIB << 20)) == 0
    for mapping in victim.maps():
        if not mapping.private_writable:  # code, read-only data, the vdso
            assert _covered(ranges, mapping.start, mapping.end) == 0, mapping


def test_maps_lines_with_and_without_a_path_parse() -> None:
    text = ("55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]\n"
            "7f00a0000000-7f00e0000000 rw-p 00000000 fd:01 1234                       /var/lib/forkd/a b/memory\n"
            "7f00e0000000-7f00e0001000 rw-s 00000000 00:00 0 \n"
            "7f00f0000000-7f00f0001000 ---p 00000000 00:00 0\n")
    heap, ram, shared, guard = pageout.parse_maps(text)
    assert (heap.anonymous, heap.private_writable, heap.path) == (True, True, "[heap]")
    assert (ram.anonymous, ram.private_writable, ram.path) == (False, True, "/var/lib/forkd/a b/memory")
    assert ram.end - ram.start == 1 << 30
    assert not shared.private_writable and not guard.private_writable


def test_calls_hold_at_most_iov_max_ranges_and_call_bytes() -> None:
    big = [(0, 3 * pageout.CALL_BYTES + PAGE)]
    assert [sum(length for _, length in batch) for batch in pageout._batches(big)] == \
        [pageout.CALL_BYTES] * 3 + [PAGE]
    scattered = [(i * 2 * PAGE, i * 2 * PAGE + PAGE) for i in range(pageout.IOV_MAX + 5)]
    batches = list(pageout._batches(scattered))
    assert [len(batch) for batch in batches] == [pageout.IOV_MAX, 5]
    assert [start for batch in batches for start, _ in batch] == [start for start, _ in scattered]


def _unmapped_page(maps: list[pageout.Mapping]) -> int:
    """A page mapped by nothing, between two of the process's mappings: an address past the last one can
    lie beyond the user address space (the stack's place is random), and the kernel then refuses the
    whole call (EFAULT) instead of stopping at that range, which is not what the test is about."""
    spans = sorted((m.start, m.end) for m in maps if m.end < 1 << 47)  # not the vsyscall page
    return next(end for (_, end), (start, _) in zip(spans, spans[1:]) if start - end >= PAGE)


def test_a_range_the_kernel_refuses_is_skipped_and_the_ranges_after_it_are_still_paged_out(victim: Victim) -> None:
    hole = _unmapped_page(victim.maps())
    pidfd = os.pidfd_open(victim.pid)
    try:
        advised, gone = pageout._advise(pidfd, [(victim.anon, PAGE), (hole, PAGE), (victim.anon + PAGE, 2 * PAGE)])
    finally:
        os.close(pidfd)
    assert (advised, gone) == (3 * PAGE, False)


def test_a_stop_asked_before_the_first_call_pages_out_nothing(victim: Victim) -> None:
    assert pageout.page_out(victim.pid, lambda: True, 5.0) == pageout.Pageout(0, False)


def test_a_gone_process_pages_out_nothing() -> None:
    process = subprocess.Popen(["true"])
    process.wait()
    assert pageout.page_out(process.pid, lambda: False, 5.0).complete is False


def test_swap_is_read_from_the_swaps_table(tmp_path: Path) -> None:
    swaps = tmp_path / "swaps"
    swaps.write_text("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")
    assert pageout.swap_bytes(swaps) == 0
    swaps.write_text(swaps.read_text() + "/dev/zram0                              partition\t262140\t\t0\t\t100\n"
                     "/swapfile                               file\t\t1024\t\t0\t\t-2\n")
    assert pageout.swap_bytes(swaps) == (262140 + 1024) << 10


class _ProcessVmm:
    """The part of a Vmm the reclaim uses: memory of a real process."""

    def memory_stats(self, vm: VmHandle) -> MemoryStats:
        return read_memory_stats(vm.pid)


def _handle(victim: Victim) -> VmHandle:
    return VmHandle(name="victim", run_dir=Path("/nonexistent"), process=victim.process,  # type: ignore[arg-type]
                    agent_socket=Path("/nonexistent"))


def test_without_swap_nothing_is_paged_out_and_the_log_says_so_once(
        victim: Victim, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    swaps = tmp_path / "swaps"
    swaps.write_text("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")
    called: list[int] = []
    monkeypatch.setattr("forkd.runtime.reclaim.page_out", lambda pid, *_: called.append(pid))
    reclaim = Reclaim(_ProcessVmm(), enabled=True, swaps=swaps)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, "forkd.reclaim")

    async def twice() -> list[int | None]:
        return [await reclaim.run(_handle(victim), lambda: True) for _ in range(2)]

    assert asyncio.run(twice()) == [None, None]
    assert called == [] and reclaim.children == 0
    assert [r.getMessage() for r in caplog.records].count(
        "this host has no swap, so idle-stopped children keep their memory in RAM (docs/operations.md, "
        "'Idle children are stopped', says how to add zram swap)") == 1


def test_disabled_reclaim_reads_nothing(victim: Victim, tmp_path: Path) -> None:
    reclaim = Reclaim(_ProcessVmm(), enabled=False, swaps=tmp_path / "absent")  # type: ignore[arg-type]
    assert asyncio.run(reclaim.run(_handle(victim), lambda: True)) is None


@pytest.mark.root("mkswap", "swapon")
def test_with_swap_its_own_pages_leave_ram_and_come_back_intact(victim: Victim, zram: str) -> None:
    before = read_memory_stats(victim.pid)
    reclaim = Reclaim(_ProcessVmm(), enabled=True)  # type: ignore[arg-type]
    dropped = asyncio.run(reclaim.run(_handle(victim), lambda: True))
    after = read_memory_stats(victim.pid)
    assert dropped is not None and dropped >= (ANON_MIB << 10) - 64  # KiB: at least the anonymous region
    assert after.private_dirty_kib < before.private_dirty_kib - (ANON_MIB << 10) + 64
    assert reclaim.children == 1 and reclaim.paged_out_bytes == dropped << 10
    assert zram_swap.mm_stat(zram)["orig_data_size"] >= ANON_MIB << 20
    assert victim.intact()
