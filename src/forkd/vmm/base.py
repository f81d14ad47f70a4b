"""The one interface every VMM backend implements (QEMU today, Firecracker later).

The runtime never builds a command line or speaks a monitor protocol itself: it asks a backend to
boot a parent, save it, and restore children from what was saved. The core :class:`Vmm` is what
every backend must do, with its disk format (``forkd.vmm.disk``: how a snapshot's disk is named,
layered, exported, flattened and checked, so nothing outside ``vmm/`` knows it); optional features
(BRANCH of a running VM: ``forkd.vmm.branching``) are announced in :class:`Capabilities` and reached
through an attribute, so a backend without them still fits (as in Kata's virtcontainers hypervisor
capabilities).
"""

from __future__ import annotations

import asyncio
import os
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from forkd.vmm.disk import DiskFormat

#: In a VM's run directory: the guest's serial console. A backend opens it for appending, so the
#: runtime can cut it while the VMM writes (a guest decides how much it writes there).
CONSOLE_LOG = "console.log"
CONSOLE_KEEP_BYTES = 64 << 10  # what a cut console keeps of its end: the guest's last words


class VmmError(RuntimeError):
    """A VMM operation failed; the message says which and what to check."""

    kind = "vmm_error"


class SnapshotMismatch(VmmError):
    """A snapshot was saved under a different VMM/machine identity than the one restoring it."""

    kind = "snapshot_mismatch"


@dataclass(frozen=True)
class Capabilities:
    kind: str
    version: str
    accelerator: str  # "kvm" or "tcg"
    accelerator_reason: str  # why that accelerator was chosen
    shared_memory_snapshots: bool  # RAM saved by reference (x-ignore-shared), never copied
    vmgenid: bool  # the guest is told it was restored, so its kernel reseeds its RNG
    background_snapshot: bool  # live snapshot while the guest runs (userfaultfd write-protect)
    branching: bool  # BRANCH a running VM: the backend's ``branching`` attribute is a forkd.vmm.branching.Branching
    machine: str  # the pinned, versioned machine type (never an alias a point release may move)
    cpu_model: str  # the guest CPU model and flags
    #: The machine types (``MACHINES``) a snapshot may ask for on this backend; the first is the default.
    machines: tuple[str, ...] = ("q35",)


@dataclass(frozen=True)
class MachineIdentity:
    """Everything that must be equal for saved device state to load into a new VMM process."""

    vmm: str
    vmm_version: str
    machine: str
    accelerator: str
    cpu_model: str
    memory_mib: int
    vcpus: int
    kernel_sha256: str
    agent_version: str

    def differences(self, other: MachineIdentity) -> list[str]:
        """Human-readable list of fields that differ, ``saved X, now Y``."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: saved {mine[k]!r}, now {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineIdentity:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


#: The machine types a snapshot can be made on, by forkd's name for them: ``q35`` (PCI Express, ACPI,
#: firmware; every backend) and ``microvm`` (no PCI, virtio-mmio, no firmware: a smaller device state
#: and VMM per child). A backend announces those it runs in :attr:`Capabilities.machines`.
Q35 = "q35"
MICROVM = "microvm"
MACHINES = (Q35, MICROVM)


def machine_of(identity_machine: str) -> str:
    """forkd's name (``MACHINES``) for the machine a recorded identity pins: ``microvm-forkd1`` is
    microvm; anything else (``pc-q35-7.2``, a fake backend's) is q35."""
    return MICROVM if identity_machine.startswith(MICROVM) else Q35


@dataclass(frozen=True)
class BootSpec:
    """What a VM is made of; identical for a parent and the children restored from it."""

    kernel: Path
    initrd: Path
    cmdline: str
    memory_mib: int
    vcpus: int
    kernel_sha256: str
    agent_version: str
    #: The machine type (``MACHINES``); a snapshot records it in its meta, so its children are restored
    #: on the machine it was made on. Snapshots from before it was recorded: q35.
    machine: str = Q35


class VmProcess(Protocol):
    """What the runtime needs of a VMM process: an ``asyncio`` subprocess, or an adopted one after a restart."""

    pid: int
    returncode: int | None

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class ChildSetup:
    """What the host prepared for one child before its VMM starts.

    ``tap_fd`` is a tap opened inside the child's network namespace, passed to the VMM, which
    itself needs no network; without one the NIC sits on a dead hub port with its link down.
    ``on_spawn`` runs with the VMM's pid before any guest state is loaded (e.g. joins a cgroup).
    ``on_stage`` is told the name of each stage of starting the VMM as it ends (``exec``,
    ``qmp_greeting``, ...), so the runtime can say where a spawn's time went.
    ``translation_cache_mib`` asks a backend that translates guest code (QEMU's TCG) for at least
    this much cache, so code translated ahead of time (a warm pool member's) is not flushed by the
    child's first calls; None: the backend's default. Backends without one ignore it.
    """

    tap_fd: int | None = None
    on_spawn: Callable[[int], None] | None = None
    on_stage: Callable[[str], None] | None = None
    translation_cache_mib: int | None = None


def no_stage_marks(stage: str) -> None:
    """The ``on_stage`` of a caller who does not time stages."""


@dataclass(eq=False)  # a handle is one process: identity, not value, equality
class VmHandle:
    """A running VMM process, where its guest agent answers, and the backend's own state of it.

    ``agent_socket`` is a host Unix socket carrying the guest protocol's byte stream (QEMU's
    virtio-serial chardev). A backend whose channel needs more than a connect (Firecracker's vsock
    proxy wants a ``CONNECT <port>`` line first) subclasses this and overrides :meth:`open_agent`.
    ``state`` belongs to the backend alone: JSON-serialisable, persisted with the sandbox record by
    the runtime without looking inside, and handed back to :meth:`Vmm.adopt` after a daemon restart.
    """

    name: str
    run_dir: Path
    process: VmProcess
    agent_socket: Path
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def open_agent(self, limit: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A fresh byte stream to the guest agent (raises ``FileNotFoundError``/``ConnectionRefusedError``
        while the VMM has not opened it yet)."""
        return await asyncio.open_unix_connection(str(self.agent_socket), limit=limit)

    def exit_report(self) -> str:
        """Why the VMM ended, from what it and the guest said last, for an error about a VM that ended
        on its own; ``""`` when the backend cannot tell. Reads files: call it off the event loop."""
        return ""

    def bound_logs(self, max_bytes: int) -> bool:
        """Cut the guest's console to its last ``CONSOLE_KEEP_BYTES`` once it holds more than ``max_bytes``
        (a guest writing its serial port without end would fill the host's disk); True if it was cut.
        Reads and writes a file: call it off the event loop."""
        return _cut_to_end(self.run_dir / CONSOLE_LOG, max_bytes, CONSOLE_KEEP_BYTES)


def _cut_to_end(path: Path, max_bytes: int, keep: int) -> bool:
    """Truncate an append-only log past ``max_bytes`` to a note and its last ``keep`` bytes.

    The writer appends (``O_APPEND``), so its next write lands after what is kept; a write racing the
    cut may be lost, which a console can afford.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # not written yet, or gone with its VM
        return False
    try:
        size = os.fstat(fd).st_size
        if size <= max_bytes:
            return False
        end = os.pread(fd, keep, max(0, size - keep))
        os.ftruncate(fd, 0)
        os.write(fd, f"[forkd: the console passed {max_bytes} bytes; its first {size - len(end)} were cut]\n".encode()
                 + end)
        return True
    finally:
        os.close(fd)


class PageLayer(Protocol):
    """A diff layer of guest RAM pages (the store's format, ``forkd.store.layers``), as a backend reads it:
    the file and its runs of ``(guest offset, file position, length)``, lowest layer first."""

    path: Path

    def runs(self) -> Iterable[tuple[int, int, int]]: ...


PAGE_SIZE = 4096  # of guest RAM, as layers and captures count it


@dataclass(frozen=True)
class Pages:
    """Guest RAM pages held in memory: their offsets (ascending) and their bytes, page after page.

    What a BRANCH copies out of a paused VMM (the pages it holds privately); the store writes them
    as a layer (``forkd.store.layers``).
    """

    offsets: array  # unsigned 64-bit page offsets into guest RAM, ascending
    data: memoryview  # len(offsets) × PAGE_SIZE bytes

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """``(guest offset, position in data, length)`` of each run of adjacent pages."""
        return page_runs(self.offsets, PAGE_SIZE, 0)


def page_runs(offsets: array, page_size: int, data_start: int) -> Iterator[tuple[int, int, int]]:
    """``(guest offset, position, length)`` of each run of adjacent pages whose data lies one page
    after another from ``data_start``."""
    i, count = 0, len(offsets)
    while i < count:
        j = i + 1
        while j < count and offsets[j] == offsets[j - 1] + page_size:
            j += 1
        yield offsets[i], data_start + i * page_size, (j - i) * page_size
        i = j


@dataclass(frozen=True)
class SavedVm:
    """The files a saved parent consists of: RAM image, device state and frozen disk."""

    memory: Path
    state: Path
    disk: Path
    identity: MachineIdentity
    layers: tuple[PageLayer, ...] = ()  # diff snapshots laid over memory, base first
    state_format: str = ""  # "": what the backend's save writes; else what a BRANCH capture said it wrote


@dataclass(frozen=True)
class MemoryStats:
    """Memory of a VMM process from /proc/<pid>/smaps_rollup, in KiB."""

    rss_kib: int
    pss_kib: int
    private_dirty_kib: int


class Vmm(Protocol):
    """The core of a VMM backend: boot, save, restore, adopt, kill, stats, and its disk format. Every
    method is safe to call concurrently for different VMs. Optional features (BRANCH) are separate
    protocols, announced in :class:`Capabilities` and reached through attributes (see
    ``forkd.vmm.branching``)."""

    program: str  # file name of the VMM binary, to recognise its processes after a daemon restart
    disk: DiskFormat  # how its snapshots' disks are kept (the store, packs and runtime ask it)
    #: Files a stopped VMM leaves in its run directory that nothing needs (sockets): a baked
    #: snapshot's directory is its parent's run directory, and they are removed from it.
    run_leftovers: tuple[str, ...]

    def capabilities(self) -> Capabilities: ...

    def identity(self, spec: BootSpec) -> MachineIdentity: ...

    async def boot(self, name: str, spec: BootSpec, run_dir: Path, base_disk: Path, memory: Path) -> VmHandle:
        """Cold-boot a VM whose RAM lives in the file ``memory``, shared so it can be saved by reference."""
        ...

    async def save(self, vm: VmHandle, state: Path) -> None:
        """Pause the VM and write its device and vCPU state to ``state``; RAM stays in its memory file."""
        ...

    async def prepare_restore(self, name: str, saved: SavedVm, spec: BootSpec, run_dir: Path,
                              setup: ChildSetup = ChildSetup()) -> VmHandle:
        """Start a child's VMM mapping ``saved.memory`` copy-on-write, waiting for its state (not running)."""
        ...

    async def complete_restore(self, vm: VmHandle, saved: SavedVm,
                               on_stage: Callable[[str], None] = no_stage_marks) -> None:
        """Load ``saved``'s layers and device state into a prepared VMM and let the guest run
        (marking ``state_loaded`` and ``cont``, or the backend's own stages, through ``on_stage``)."""
        ...

    async def pause(self, vm: VmHandle) -> None:
        """Stop the guest's vCPUs (the VMM keeps its memory, devices and translations) until :meth:`resume`."""
        ...

    async def resume(self, vm: VmHandle) -> None:
        """Let a guest stopped by :meth:`pause` run again."""
        ...

    async def adopt(self, name: str, process: VmProcess, run_dir: Path, state: dict[str, Any],
                    stopped_ok: bool = False) -> VmHandle:
        """Take over a VMM a previous daemon started, from the ``VmHandle.state`` it persisted;
        raise :class:`VmmError` unless it is running (and answers within a bounded time). With
        ``stopped_ok`` a guest stopped by :meth:`pause` (a daemon that died inside a BRANCH's pause)
        is taken over too, still stopped: the caller resumes it."""
        ...

    async def kill(self, vm: VmHandle) -> None: ...

    def memory_stats(self, vm: VmHandle) -> MemoryStats: ...


async def restore(vmm: Vmm, name: str, saved: SavedVm, spec: BootSpec, run_dir: Path,
                  setup: ChildSetup = ChildSetup()) -> VmHandle:
    """Prepare and complete a restore in one go; the VMM is killed if loading its state fails."""
    vm = await vmm.prepare_restore(name, saved, spec, run_dir, setup)
    try:
        await vmm.complete_restore(vm, saved, setup.on_stage or no_stage_marks)
    except BaseException:
        await vmm.kill(vm)
        raise
    return vm
