"""The one interface every VMM backend implements (QEMU today, Firecracker later).

The runtime never builds a command line or speaks a monitor protocol itself: it asks a backend to
boot a parent, save it, and restore children from what was saved. Backends say what they can do
through :class:`Capabilities` rather than the runtime assuming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol


class VmmError(RuntimeError):
    """A VMM operation failed; the message says which and what to check."""


class SnapshotMismatch(VmmError):
    """A snapshot was saved under a different VMM/machine identity than the one restoring it."""


@dataclass(frozen=True)
class Capabilities:
    kind: str
    version: str
    accelerator: str  # "kvm" or "tcg"
    accelerator_reason: str  # why that accelerator was chosen
    shared_memory_snapshots: bool  # RAM saved by reference (x-ignore-shared), never copied
    vmgenid: bool  # the guest is told it was restored, so its kernel reseeds its RNG
    background_snapshot: bool  # live snapshot while the guest runs (userfaultfd write-protect)


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
    ``on_stage`` is told the name of each restore stage as it ends (exec, monitor greeting, state
    loaded, ...), so the runtime can say where a spawn's time went.
    """

    tap_fd: int | None = None
    on_spawn: Callable[[int], None] | None = None
    on_stage: Callable[[str], None] | None = None


@dataclass(eq=False)  # a handle is one process: identity, not value, equality
class VmHandle:
    """A running VMM process and the host-side endpoints it exposes."""

    name: str
    run_dir: Path
    process: VmProcess
    agent_socket: Path
    monitor_socket: Path
    disk: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass(frozen=True)
class SavedVm:
    """The files a saved parent consists of: RAM image, device state and frozen disk."""

    memory: Path
    state: Path
    disk: Path
    identity: MachineIdentity
    layers: tuple[Any, ...] = ()  # diff snapshots: forkd.store.layers.Layer laid over memory, base first


@dataclass(frozen=True)
class MemoryStats:
    """Memory of a VMM process from /proc/<pid>/smaps_rollup, in KiB."""

    rss_kib: int
    pss_kib: int
    private_dirty_kib: int
    shared_clean_kib: int


class Vmm(Protocol):
    """A VMM backend. Every method is safe to call concurrently for different VMs."""

    program: str  # file name of the VMM binary, to recognise its processes after a daemon restart

    def capabilities(self) -> Capabilities: ...

    def identity(self, spec: BootSpec) -> MachineIdentity: ...

    async def boot(self, name: str, spec: BootSpec, run_dir: Path, base_disk: Path, memory: Path) -> VmHandle:
        """Cold-boot a VM whose RAM lives in the file ``memory``, shared so it can be saved by reference."""
        ...

    async def pause(self, vm: VmHandle) -> None: ...

    async def resume(self, vm: VmHandle) -> None: ...

    async def save(self, vm: VmHandle, state: Path) -> None:
        """Write the paused VM's device and vCPU state to ``state``; RAM stays in its memory file."""
        ...

    async def restore(self, name: str, saved: SavedVm, spec: BootSpec, run_dir: Path,
                      setup: ChildSetup = ChildSetup()) -> VmHandle:
        """Start a child that maps ``saved.memory`` copy-on-write and resumes from ``saved.state``."""
        ...

    async def prepare_restore(self, name: str, saved: SavedVm, spec: BootSpec, run_dir: Path,
                              setup: ChildSetup = ChildSetup()) -> VmHandle:
        """The first half of :meth:`restore`: a VMM started and waiting for its state, no guest code run.

        It may wait for any time (a pool of ready VMMs); :meth:`complete_restore` then loads the
        state and runs it. Kill it with :meth:`kill` if it is never completed.
        """
        ...

    async def complete_restore(self, vm: VmHandle, on_stage: Callable[[str], None] | None = None) -> VmHandle:
        """The second half of :meth:`restore`: load the state into a prepared VMM and run it."""
        ...

    async def adopt(self, name: str, process: VmProcess, run_dir: Path, agent_socket: Path, monitor_socket: Path,
                    disk: Path) -> VmHandle:
        """Take over a VMM a previous daemon started; raise :class:`VmmError` unless it is running."""
        ...

    async def kill(self, vm: VmHandle) -> None: ...

    def memory_stats(self, vm: VmHandle) -> MemoryStats: ...

    async def capture(self, vm: VmHandle, new_top: Path, stream: Path, live: bool) -> Any:
        """Pause, freeze the disk (the VM continues in ``new_top``), stream RAM + devices, resume."""
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
