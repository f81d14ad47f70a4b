"""The optional BRANCH capability: save a *running* VM as a new snapshot while it keeps running.

A backend that can do it sets ``Capabilities.branching`` and exposes an object implementing
:class:`Branching` as its ``branching`` attribute; the runtime asks :func:`branching_of` and gets a
clear error when the backend cannot. The core :class:`forkd.vmm.base.Vmm` stays free of it, so a
backend that only boots, saves and restores (a first Firecracker backend) needs nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from forkd.vmm.base import BootSpec, VmHandle, Vmm, VmmError


class BranchingUnsupported(VmmError):
    """The VMM backend cannot branch a running VM."""


@dataclass(frozen=True)
class Capture:
    pause_s: float  # the guest was not running for this long
    frozen_disk: Path  # the disk layer the source wrote until the pause; it now backs the source's new top


class Branching(Protocol):
    async def capture(self, vm: VmHandle, new_top: Path, stream: Path, live: bool) -> Capture:
        """Pause, freeze the disk (the VM continues in ``new_top``), stream RAM + devices to ``stream``, resume."""
        ...

    async def export_disk_layer(self, frozen: Path, dest: Path, backing_name: str) -> None:
        """Copy a frozen disk layer into a snapshot, backed by ``backing_name`` (relative to ``dest``)."""
        ...

    async def flatten_disk(self, disk: Path, base_name: str) -> None:
        """Make ``disk`` hold everything its backing chain held above the raw ``base_name`` next to it."""
        ...

    async def reparent(self, spec: BootSpec, stream: Path, disk: Path, memory: Path, state: Path,
                       work_dir: Path) -> None:
        """Turn a capture into ``memory`` (RAM file) + ``state`` (devices only): a snapshot's files."""
        ...


def branching_of(vmm: Vmm) -> Branching:
    """The backend's branching capability, or :class:`BranchingUnsupported` saying which backend lacks it."""
    caps = vmm.capabilities()
    implementation: Branching | None = getattr(vmm, "branching", None)
    if not caps.branching or implementation is None:
        raise BranchingUnsupported(f"the {caps.kind} VMM backend cannot branch a running sandbox or compact "
                                   "snapshots; use a backend that can (qemu)")
    return implementation
