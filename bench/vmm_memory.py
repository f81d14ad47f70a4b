"""Where one VMM's Private_Dirty goes, mapping by mapping, from /proc/<pid>/smaps (needs root).

Finer than ``spawn.smaps_breakdown`` (which ``child_cost.py`` and ``density.py`` report): each
anonymous mapping is named by what holds it, told from the process itself, not guessed from sizes:

- a thread's stack: the mapping that holds the stack pointer in ``/proc/<pid>/task/<tid>/syscall``
  (a blocked thread's registers), labelled with the thread's name (``CPU 0/TCG``, ``qemu-rcu``, ...);
- a glibc malloc arena: a read-write anonymous mapping starting on a 64 MiB boundary with its
  ``---p`` reserve after it (glibc aligns every non-main arena's heap to ``HEAP_MAX_SIZE``);
- the TCG translation cache: QEMU's only anonymous executable mapping;
- guest RAM copied on write: the snapshot's memory file; QEMU's heap (``[heap]``, the main arena);
- the rest of the anonymous memory by size (``mmap``'d ``malloc`` blocks above the mmap threshold,
  QEMU's RAM blocks such as option ROMs and firmware, coroutine stacks);
- files by path (relocated data of QEMU and its libraries).

``in_huge_pages`` is how much of it sits in transparent huge pages (QEMU advises them for its RAM
blocks and its translation buffer): a huge page is dirty as a whole once one byte of it is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARENA_ALIGN = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit


def thread_stacks(pid: int) -> dict[int, str]:
    """Stack pointer → thread name of every thread of ``pid`` that is blocked in a system call."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "syscall").read_text().split()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        if len(fields) >= 3 and fields[0] not in {"running", "-1"}:
            found[int(fields[-2], 16)] = name
    return found


def mappings(pid: int) -> list[dict[str, Any]]:
    """Every mapping of ``pid``: start, end, permissions, path and Private_Dirty (KiB)."""
    out: list[dict[str, Any]] = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append({"start": start, "end": end, "perms": fields[1],
                        "path": fields[5] if len(fields) > 5 else "", "private_dirty_kib": 0, "huge_kib": 0})
        elif fields[0] == "Private_Dirty:":
            out[-1]["private_dirty_kib"] = int(fields[1])
        elif fields[0] == "AnonHugePages:":
            out[-1]["huge_kib"] = int(fields[1])
    return out


def detailed(pid: int, memory_file: str) -> dict[str, Any]:
    """Private_Dirty of one VMM in MiB by what holds it, with the largest unexplained mappings listed."""
    maps = mappings(pid)
    stacks = thread_stacks(pid)
    kinds: dict[str, float] = {}
    other: list[dict[str, Any]] = []
    arenas = 0

    def add(kind: str, kib: int) -> None:
        kinds[kind] = kinds.get(kind, 0) + kib

    for index, m in enumerate(maps):
        kib = m["private_dirty_kib"]
        path, perms = m["path"], m["perms"]
        after = maps[index + 1] if index + 1 < len(maps) else None
        holder = next((name for sp, name in stacks.items() if m["start"] <= sp < m["end"]), None)
        if path == memory_file:
            add("guest_ram_cow", kib)
        elif path == "[heap]":
            add("heap_main_arena", kib)
        elif path == "[stack]" or holder is not None:
            add("thread_stacks", kib)
        elif not path and "x" in perms:
            add("tcg_cache", kib)
        elif (not path and perms.startswith("rw") and m["start"] % ARENA_ALIGN == 0 and after is not None
              and after["start"] == m["end"] and after["perms"].startswith("---")):
            add("malloc_arenas", kib)
            arenas += 1
        elif not path or path.startswith("["):
            add("other_anonymous", kib)
            if kib:
                other.append({"size_kib": (m["end"] - m["start"]) >> 10, "private_dirty_kib": kib, "perms": perms})
        else:
            add("files", kib)
    other.sort(key=lambda o: -o["private_dirty_kib"])
    summary = {k: round(v / 1024, 2) for k, v in sorted(kinds.items())}
    huge = sum(m["huge_kib"] for m in maps)
    return {**summary, "total": round(sum(kinds.values()) / 1024, 2), "in_huge_pages": round(huge / 1024, 2),
            "malloc_arena_count": arenas,
            "threads": sorted(stacks.values()), "largest_other": other[:12]}
