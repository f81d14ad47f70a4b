"""The optional BRANCH capability: save a *running* VM as a new snapshot while it keeps running.

A backend that can do it sets ``Capabilities.branching`` and exposes an object implementing
:class:`Branching` as its ``branching`` attribute; the runtime asks :func:`branching_of` and gets a
clear error when the backend cannot. The core :class:`forkd.vmm.base.Vmm` stays free of it, so a
backend that only boots, saves and restores (a first Firecracker backend) needs nothing here. What
becomes of the frozen disk layer afterwards (exported into the snapshot) is the backend's disk
format's (:class:`forkd.vmm.disk.DiskFormat`), which every backend has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from forkd.vmm.base import Pages, VmHandle, Vmm, VmmError


class BranchingUnsupported(VmmError):
    """The VMM backend cannot branch a running VM."""


@dataclass(frozen=True)
class Capture:
    """What a BRANCH took from the source while it was stopped (and, ``live``, before)."""

    pause_s: float  # the guest was not running for at most this long
    frozen_disk: Path  # the disk layer the source wrote until the pause; it now lies under the source's new disk
    pages: Pages  # guest RAM the source holds privately over its memory file: what it changed
    state_format: str  # how the device state file was written; a restore is told (SavedVm.state_format)
    precopied: bool  # live: pages were copied while the guest ran and only re-written ones re-read


class Branching(Protocol):
    async def capture(self, vm: VmHandle, memory_bytes: int, state: Path,
                      live: bool, mark: Callable[[str], None]) -> Capture:
        """Stop the guest; switch its disk to a new empty one in its run directory over the old one,
        which freezes (``vm.state`` records the new one); write its device state (no RAM) to
        ``state``; copy the pages of its ``memory_bytes`` of guest RAM it holds privately over the
        memory file it was restored from (what it changed since); resume it.

        ``mark(stage)`` is called as each stage ends (``runtime/timings.py`` names). ``live`` first
        copies the pages while the guest runs, then re-reads only those written since, where the
        host kernel can tell.
        """
        ...


def branching_of(vmm: Vmm) -> Branching:
    """The backend's branching capability, or :class:`BranchingUnsupported` saying which backend lacks it."""
    caps = vmm.capabilities()
    implementation: Branching | None = getattr(vmm, "branching", None)
    if not caps.branching or implementation is None:
        raise BranchingUnsupported(f"the {caps.kind} VMM backend cannot branch a running sandbox; use a backend "
                                   "that can (qemu)")
    return implementation
