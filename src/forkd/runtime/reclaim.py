"""A child stopped for being idle gives its memory back: its VMM's own pages are paged out to swap.

An idle-stopped child (runtime/idle.py) runs nothing, yet keeps every private page: ~40 MiB under
TCG, most of it the translation buffer, QEMU's heap and the guest pages it wrote. Right after the
stop those pages are handed to the kernel's reclaim (``vmm/pageout.py``): with swap (zram or a disk)
they leave RAM, and fault back in when the child's next request continues it, so undoing costs
nothing but those faults. Without swap an anonymous page cannot leave RAM: reclaim is skipped,
and said once in the log. Setting up swap is the operator's choice (docs/operations.md).

One child is paged out at a time (compressing pages into zram is CPU work, and the host's CPUs
serve the running children), in a worker thread, in calls of a bounded size, each preceded by a
look at whether the child is still stopped: a request that continues the child stops its reclaim
within one call, and no child takes longer than ``BUDGET_S``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from forkd.vmm.base import VmHandle, Vmm, VmmError
from forkd.vmm.pageout import PageoutError, page_out, swap_bytes

BUDGET_S = 5.0  # one child's reclaim stops after this long (zram takes ~0.1 s for 40 MiB)
log = logging.getLogger("forkd.reclaim")


class Reclaim:
    """The reclaim of idle-stopped children's memory, and what it did in all (for metrics)."""

    def __init__(self, vmm: Vmm, enabled: bool, swaps: Path = Path("/proc/swaps")) -> None:
        self.vmm = vmm
        self.enabled = enabled
        self.swaps = swaps
        self.children = 0  # reclaims that paged something out
        self.paged_out_bytes = 0  # the Private_Dirty they took away
        self._slot = asyncio.Semaphore(1)
        self._had_swap: bool | None = None  # at the last look; the log says when this changes

    async def run(self, vm: VmHandle, still_stopped: Callable[[], bool]) -> int | None:
        """Page out ``vm``'s own memory while ``still_stopped()``; KiB its Private_Dirty fell by, or None
        when nothing was done (disabled, no swap, woken first, the kernel refused)."""
        if not self.enabled:
            return None
        async with self._slot:
            if not still_stopped():
                return None
            try:
                dropped = await asyncio.to_thread(self._page_out, vm, still_stopped)
            except (PageoutError, VmmError) as exc:  # a kernel without process_madvise, or the VMM exited
                log.warning("%s: paging out its memory failed (%s)", vm.name, exc)
                return None
        if dropped is not None and dropped > 0:
            self.children += 1
            self.paged_out_bytes += dropped << 10
        return dropped

    def _page_out(self, vm: VmHandle, still_stopped: Callable[[], bool]) -> int | None:
        if not self._swap_present():
            return None
        before = self.vmm.memory_stats(vm)
        done = page_out(vm.pid, lambda: not still_stopped(), BUDGET_S)
        after = self.vmm.memory_stats(vm)
        if not done.complete and still_stopped():
            log.info("%s: paging out its memory stopped after %.1f s (%d MiB advised)", vm.name, BUDGET_S,
                     done.advised >> 20)
        return before.private_dirty_kib - after.private_dirty_kib

    def _swap_present(self) -> bool:
        """Whether the host has swap now (the operator may add or remove it while the daemon runs)."""
        present = swap_bytes(self.swaps) > 0
        if present != self._had_swap:
            if present:
                log.info("swap found: idle-stopped children's memory is paged out to it")
            else:
                log.info("this host has no swap, so idle-stopped children keep their memory in RAM "
                         "(docs/operations.md, 'Idle children are stopped', says how to add zram swap)")
            self._had_swap = present
        return present
