"""QEMU backend: parents with RAM in a shared file, children mapping that file copy-on-write.

The parent's guest RAM is a ``memory-backend-file`` with ``share=on``, so when it is paused the
file *is* its memory. Saving migrates only device and vCPU state (``x-ignore-shared`` skips shared
RAM: ~13 ms, a few hundred KB). A child is a new QEMU process with the same machine but
``share=off`` on the same file — a MAP_PRIVATE mapping, so the host kernel shares every page until
the child writes it — started with ``-incoming defer`` (:meth:`QemuVmm.prepare_restore`) and then
told over QMP to load that state (:meth:`QemuVmm.complete_restore`; QEMU 7.2 has no command-line
switch for the capability). Each VM gets its own qcow2 overlay so no two VMs ever write one disk.
The command line, process start and bounded monitor live in ``qemu_machine``; the disk format
(qcow2 layers) in ``qemu_disk``; BRANCH, an optional capability, in ``qemu_branch``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from qemu.qmp import QMPError

from forkd.vmm import guest_ram
from forkd.vmm.accel import choose_accelerator
from forkd.vmm.base import (
    BootSpec,
    Capabilities,
    ChildSetup,
    MachineIdentity,
    MemoryStats,
    SavedVm,
    VmHandle,
    VmmError,
    VmProcess,
    no_stage_marks,
)
from forkd.vmm.disk import DiskFormat
from forkd.vmm.jail import Jail
from forkd.vmm.process import read_memory_stats
from forkd.vmm.qemu_branch import DEVICE_STATE, DEVICE_STATE_ARGS, QemuBranching
from forkd.vmm.qemu_disk import QemuDisk, backing_chain
from forkd.vmm.qemu_exit import QemuVm
from forkd.vmm.qemu_machine import (
    AGENT_SOCKET,
    DISK_KEY,
    MEMORY_KEY,
    MONITOR_KEY,
    NIC_ID,
    QEMU_BINARY,
    RUN_LEFTOVERS,
    TCG_TB_SIZE_MIB,
    QemuMachine,
    cpu_model,
    kill,
    monitor,
    qemu_version,
)

ADOPT_MONITOR_TIMEOUT_S = 5.0
# Shared RAM (the memory file) is neither written to nor read from the migration stream, and QEMU
# announces each migration state change as a MIGRATION event, so nobody polls.
_MIGRATION_CAPABILITIES = {"capabilities": [{"capability": "x-ignore-shared", "state": True},
                                           {"capability": "events", "state": True}]}


class QemuVmm:
    """The :class:`forkd.vmm.base.Vmm` backend for ``qemu-system-x86_64``, with the branching capability."""

    kind = "qemu"
    run_leftovers: tuple[str, ...] = RUN_LEFTOVERS

    def __init__(self, binary: str = QEMU_BINARY, accelerator: str = "auto",
                 tb_size_mib: int = TCG_TB_SIZE_MIB, jail: Jail | None | Literal["default"] = "default",
                 huge_pages: bool = False) -> None:
        """``jail``: how each VMM is confined (checked on its first start); None runs VMMs as root."""
        self.program = Path(binary).name
        self.accelerator, self.accelerator_reason = choose_accelerator(accelerator)
        self.machine = QemuMachine(binary, self.accelerator, cpu_model(self.accelerator),
                                   Jail() if jail == "default" else jail, tb_size_mib=tb_size_mib,
                                   huge_pages=huge_pages)
        self.branching = QemuBranching()
        self.disk: DiskFormat = QemuDisk()
        self._offline: set[VmHandle] = set()  # prepared children without a tap: their link goes down on load

    @property
    def cpu_model(self) -> str:
        return self.machine.cpu_model

    def capabilities(self) -> Capabilities:
        """What this backend offers. Its first call also does the backend's one-time work (cached for the
        daemon's life: :meth:`QemuMachine.warm_up`); ``Runtime.start`` makes that call off the event loop,
        so no command line or VMM start does it on the loop."""
        self.machine.warm_up()
        return Capabilities(
            kind=self.kind,
            version=qemu_version(self.machine.binary),
            accelerator=self.accelerator,
            accelerator_reason=self.accelerator_reason,
            shared_memory_snapshots=True,
            vmgenid=True,
            background_snapshot=True,
            branching=True,
            machine=self.machine.machine,
            cpu_model=self.cpu_model,
            machines=self.machine.machines(),
        )

    def identity(self, spec: BootSpec) -> MachineIdentity:
        return MachineIdentity(
            vmm=self.kind,
            vmm_version=qemu_version(self.machine.binary),
            machine=self.machine.identity_of(spec.machine),
            accelerator=self.accelerator,
            cpu_model=self.cpu_model,
            memory_mib=spec.memory_mib,
            vcpus=spec.vcpus,
            kernel_sha256=spec.kernel_sha256,
            agent_version=spec.agent_version,
        )

    async def boot(self, name: str, spec: BootSpec, run_dir: Path, base_disk: Path, memory: Path) -> VmHandle:
        disk = run_dir / self.disk.file_name
        await self.disk.new_root(base_disk, disk)
        files = self.machine.host_files(spec, await asyncio.to_thread(backing_chain, disk), memory, share=True)
        # -S: the guest runs only once QEMU answers its monitor, so after a jailed QEMU dropped to its uid.
        return await self.machine.start(name, [*self.machine.argv(spec, run_dir, disk, memory, share=True), "-S"],
                                        run_dir, disk, files=files, setup=lambda qmp: qmp.execute("cont"))

    async def prepare_restore(self, name: str, saved: SavedVm, spec: BootSpec, run_dir: Path,
                              setup: ChildSetup = ChildSetup()) -> VmHandle:
        """A QEMU started with ``-incoming defer`` on the snapshot's memory and a fresh overlay.

        It needs neither the device state nor a layer yet: those arrive in :meth:`complete_restore`
        (the state file as an fd over the monitor), so VMMs can be started ahead of a fork.
        """
        mark = setup.on_stage or no_stage_marks
        disk = run_dir / self.disk.file_name
        await self.disk.new_child(saved.disk, disk)
        mark("overlay")
        argv = self.machine.argv(spec, run_dir, disk, saved.memory, share=False, tap_fd=setup.tap_fd,
                                 tb_size_mib=setup.translation_cache_mib)
        if saved.state_format == DEVICE_STATE:  # written by a BRANCH: devices only, no configuration section
            argv += DEVICE_STATE_ARGS
        # -S: the guest runs only on complete_restore's `cont`, whatever run state the saved state holds.
        files = self.machine.host_files(spec, await asyncio.to_thread(backing_chain, disk), saved.memory, share=False)
        vm = await self.machine.start(name, argv + ["-incoming", "defer", "-S"], run_dir, disk,
                                      pass_fds=() if setup.tap_fd is None else (setup.tap_fd,), files=files,
                                      on_spawn=setup.on_spawn, on_stage=mark)
        vm.state[MEMORY_KEY] = str(saved.memory)
        if setup.tap_fd is None:
            self._offline.add(vm)
        return vm

    async def complete_restore(self, vm: VmHandle, saved: SavedVm,
                               on_stage: Callable[[str], None] = no_stage_marks) -> None:
        offline = vm in self._offline
        self._offline.discard(vm)
        memory_bytes = saved.identity.memory_mib << 20
        if saved.layers:  # a diff snapshot: its pages go into the mapping before the state loads
            await asyncio.to_thread(guest_ram.write_layers, vm.pid, saved.memory, memory_bytes, list(saved.layers))
            on_stage("layers")
        state_fd = os.open(saved.state, os.O_RDONLY)
        try:
            async with monitor(vm) as qmp:
                await qmp.execute("migrate-set-capabilities", _MIGRATION_CAPABILITIES)
                qmp.send_fd_scm(state_fd)
                await qmp.execute("getfd", {"fdname": "forkd-state"})
                # Device state from the file; RAM comes from the mapped memory file.
                await qmp.migrate("restoring", "migrate-incoming", {"uri": "fd:forkd-state"})
                on_stage("state_loaded")
                if offline:  # the guest sees no carrier: a child without network
                    await qmp.execute("set_link", {"name": NIC_ID, "up": False})
                await qmp.execute("cont")  # the parent was paused when saved, so the child loads paused
                on_stage("cont")
        except QMPError as exc:
            raise VmmError(f"restoring {vm.name} failed: {exc}") from None
        finally:
            os.close(state_fd)

    async def save(self, vm: VmHandle, state: Path) -> None:
        """Migrate the VM's device state into ``state`` through a passed file descriptor (pausing it first)."""
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            async with monitor(vm) as qmp:
                await qmp.execute("stop")
                await qmp.execute("migrate-set-capabilities", _MIGRATION_CAPABILITIES)
                qmp.send_fd_scm(fd)
                await qmp.execute("getfd", {"fdname": "forkd-state"})
                await qmp.migrate("saving", "migrate", {"uri": "fd:forkd-state"})
        except QMPError as exc:
            raise VmmError(f"saving {vm.name} failed: {exc}") from None
        finally:
            os.close(fd)
        with open(state, "rb+") as written:
            os.fsync(written.fileno())

    async def pause(self, vm: VmHandle) -> None:
        await self._run_state(vm, "stop")

    async def resume(self, vm: VmHandle) -> None:
        await self._run_state(vm, "cont")

    @staticmethod
    async def _run_state(vm: VmHandle, command: str) -> None:
        """``stop`` or ``cont`` over QMP: vCPUs halt or run; memory, devices and TCG's translations stay."""
        try:
            async with monitor(vm) as qmp:
                await qmp.execute(command)
        except QMPError as exc:
            raise VmmError(f"{command} of {vm.name} failed: {exc}") from None

    async def adopt(self, name: str, process: VmProcess, run_dir: Path, state: dict[str, Any],
                    stopped_ok: bool = False) -> VmHandle:
        if not isinstance(state.get(MONITOR_KEY), str) or not isinstance(state.get(DISK_KEY, ""), str):
            raise VmmError(f"the record of {name} lacks its QEMU monitor socket")
        # Records from before the schema had backend state hold no disk: it was the first one, never branched.
        state = {DISK_KEY: str(run_dir / self.disk.file_name), **state}
        vm = QemuVm(name=name, run_dir=run_dir, process=process, agent_socket=run_dir / AGENT_SOCKET,
                    state={k: state[k] for k in (MONITOR_KEY, DISK_KEY, MEMORY_KEY) if k in state})
        try:
            async with monitor(vm, wait_s=ADOPT_MONITOR_TIMEOUT_S, timeout_s=ADOPT_MONITOR_TIMEOUT_S) as qmp:
                status = (await qmp.execute("query-status")).get("status")
        except QMPError as exc:
            raise VmmError(f"the QEMU monitor of {name} failed: {exc}") from None
        if status != "running" and not (stopped_ok and status == "paused"):
            raise VmmError(f"QEMU of {name} is {status}, not running")
        return vm

    async def kill(self, vm: VmHandle) -> None:
        self._offline.discard(vm)
        await kill(vm)

    def memory_stats(self, vm: VmHandle) -> MemoryStats:
        return read_memory_stats(vm.pid)
