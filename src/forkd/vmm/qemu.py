"""QEMU backend: parents with RAM in a shared file, children mapping that file copy-on-write.

The parent's guest RAM is a ``memory-backend-file`` with ``share=on``, so when it is paused the
file *is* its memory. Saving migrates only device and vCPU state (``x-ignore-shared`` skips shared
RAM: ~13 ms, a few hundred KB). A child is a new QEMU process with the same machine but
``share=off`` on the same file — a MAP_PRIVATE mapping, so the host kernel shares every page until
the child writes it — started with ``-incoming defer`` and then told over QMP to load that state
(QEMU 7.2 has no command-line switch for the capability). Each VM gets its own qcow2 overlay so
no two VMs ever write one disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from qemu.qmp import EventListener, QMPClient, QMPError

from forkd.guest import netconf
from forkd.guest.protocol import AGENT_PORT_NAME
from forkd.vmm import qemu_branch
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
)

MACHINE = "q35"
STARTUP_TIMEOUT_S = 20.0
SAVE_TIMEOUT_S = 120.0
ADOPT_MONITOR_TIMEOUT_S = 5.0
# TCG translation buffer per VMM. Measured per child (reseed + numpy eval + one command, bench/child_cost.py,
# docs/benchmarks.md): 8 MiB → 12 buffer flushes and ~2x the CPU of 16 MiB (4 flushes); 32 MiB → 1
# flush and ~35 % less CPU than 16, but +14 MiB Private_Dirty per child. The default favours memory;
# `tcg_tb_size_mib` in the daemon's config trades it for CPU.
TCG_TB_SIZE_MIB = 16
CHILD_OVERLAY_TEMPLATE = "child-overlay.qcow2"
# Shared RAM (the memory file) is neither written to nor read from the migration stream, and QEMU
# announces each migration state change as a MIGRATION event, so nobody polls.
_MIGRATION_CAPABILITIES = {"capabilities": [{"capability": "x-ignore-shared", "state": True},
                                           {"capability": "events", "state": True}]}
# What a prepared (not yet completed) restore keeps in VmHandle.extra.
_KEPT_MONITOR, _STATE_FD, _NETWORKED = "qmp", "state_fd", "networked"
NIC_ID = "nic0"
#: An inert NIC backend: a hub with this one port, so frames go nowhere. Backends are not
#: migrated, so a parent baked on it can restore onto a tap. The tap is opened without vnet headers,
#: so the offload features the guest negotiated are the same whichever backend a child gets.
_INERT_NETDEV = "hubport,id=net0,hubid=0"


def _no_mark(stage: str) -> None:
    """Stage marks nobody asked for."""


@functools.cache
def qemu_version(binary: str) -> str:
    """``7.2.22`` from ``QEMU emulator version 7.2.22 (Debian ...)``."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise VmmError(f"cannot run {binary} ({exc}); install QEMU with `bash scripts/setup`") from None
    match = re.search(r"version (\S+)", out)
    return match.group(1) if match else out.strip()


async def create_overlay(backing: Path, overlay: Path, backing_format: str, relative: bool = False) -> None:
    """A qcow2 overlay so the VM writes its own file and ``backing`` stays untouched.

    ``relative`` records the backing file by name only, resolved next to the overlay, so a
    directory holding both can be renamed into place after it is built.
    """
    if relative and backing.parent.resolve() != overlay.parent.resolve():
        raise VmmError(f"relative backing file {backing} must sit next to {overlay}")
    backing_ref = backing.name if relative else str(backing)
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", backing_ref, "-F", backing_format, str(overlay)]
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    except (OSError, asyncio.TimeoutError) as exc:
        raise VmmError(f"qemu-img failed ({exc!r}); install qemu-utils with `bash scripts/setup`") from None
    if proc.returncode != 0:
        raise VmmError(f"qemu-img could not create {overlay}: {stderr.decode(errors='replace').strip()}")


def read_memory_stats(pid: int) -> MemoryStats:
    """Sum of the process's mappings from ``smaps_rollup`` (PSS counts shared pages fractionally)."""
    fields: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError as exc:
        raise VmmError(f"cannot read memory of process {pid}: {exc}") from None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            fields[parts[0][:-1]] = int(parts[1])
    return MemoryStats(
        rss_kib=fields.get("Rss", 0),
        pss_kib=fields.get("Pss", 0),
        private_dirty_kib=fields.get("Private_Dirty", 0),
        shared_clean_kib=fields.get("Shared_Clean", 0),
    )


class QemuVmm:
    """The :class:`forkd.vmm.base.Vmm` backend for ``qemu-system-x86_64``."""

    kind = "qemu"

    def __init__(self, binary: str = "qemu-system-x86_64", accelerator: str = "auto",
                 tb_size_mib: int = TCG_TB_SIZE_MIB) -> None:
        self.binary = binary
        self.tb_size_mib = tb_size_mib
        self.program = Path(binary).name
        self.accelerator, self.accelerator_reason = choose_accelerator(accelerator)
        self._template_lock = asyncio.Lock()

    @property
    def cpu_model(self) -> str:
        # QEMU 7.2's TCG corrupts flags in the guest kernel's SLUB cmpxchg16b fast path: 4 of 4
        # parents booted in parallel double-faulted; without cx16 the kernel takes its locked
        # fallback and 4 of 4 ran clean.
        return "host" if self.accelerator == "kvm" else "qemu64,-cx16"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            kind=self.kind,
            version=qemu_version(self.binary),
            accelerator=self.accelerator,
            accelerator_reason=self.accelerator_reason,
            shared_memory_snapshots=True,
            vmgenid=True,
            background_snapshot=True,
        )

    def identity(self, spec: BootSpec) -> MachineIdentity:
        return MachineIdentity(
            vmm=self.kind,
            vmm_version=qemu_version(self.binary),
            machine=MACHINE,
            accelerator=self.accelerator,
            cpu_model=self.cpu_model,
            memory_mib=spec.memory_mib,
            vcpus=spec.vcpus,
            kernel_sha256=spec.kernel_sha256,
            agent_version=spec.agent_version,
        )

    def _argv(self, spec: BootSpec, run_dir: Path, disk: Path, memory: Path, share: bool,
              tap_fd: int | None = None, boot: bool | None = None) -> list[str]:
        """The machine; parent and children must agree on every device for state to load.

        Only a parent (``share=True``) is given the kernel: a child's kernel is already in the RAM
        it maps, and QEMU would otherwise keep a private ~14 MB copy of vmlinuz and initrd per child.
        """
        with_kernel = share if boot is None else boot
        kernel = ["-kernel", str(spec.kernel), "-initrd", str(spec.initrd), "-append", spec.cmdline] if with_kernel else []
        accel = "kvm" if self.accelerator == "kvm" else f"tcg,tb-size={self.tb_size_mib}"
        netdev = _INERT_NETDEV if tap_fd is None else f"tap,id=net0,fd={tap_fd},vhost=off"
        return [
            self.binary,
            "-nodefaults", "-no-user-config", "-nographic", "-display", "none",
            "-no-reboot",  # a guest panic (panic=-1) ends the VMM, so it is noticed, not rebooted
            "-machine", f"{MACHINE},memory-backend=ram",
            "-accel", accel,
            "-cpu", self.cpu_model,
            "-smp", str(spec.vcpus),
            "-m", f"{spec.memory_mib}M",
            "-object",
            f"memory-backend-file,id=ram,size={spec.memory_mib}M,mem-path={memory},share={'on' if share else 'off'}",
            *kernel,
            "-drive", f"file={disk},format=qcow2,if=none,id=root,cache=writeback,discard=unmap",
            "-device", "virtio-blk-pci,drive=root,id=rootdisk",
            "-netdev", netdev,
            "-device", f"virtio-net-pci,netdev=net0,mac={netconf.GUEST_MAC},id={NIC_ID}",
            "-device", "virtio-serial-pci,id=vser",
            "-chardev", f"socket,id=agent,path={run_dir / 'agent.sock'},server=on,wait=off",
            "-device", f"virtserialport,chardev=agent,name={AGENT_PORT_NAME},id=agentport",
            # A new generation id on every restore tells the guest kernel to reseed its RNG.
            "-device", f"vmgenid,guid={uuid.uuid4()},id=vmgenid",
            "-chardev", f"file,id=console,path={run_dir / 'console.log'}",
            "-serial", "chardev:console",
            "-qmp", f"unix:{run_dir / 'qmp.sock'},server=on,wait=off",
        ]

    async def _start(self, name: str, argv: list[str], run_dir: Path, disk: Path, pass_fds: tuple[int, ...] = (),
                     setup: Callable[[QMPClient, VmHandle], Awaitable[object]] | None = None,
                     on_spawn: Callable[[int], None] | None = None, mark: Callable[[str], None] = _no_mark,
                     keep_monitor: bool = False) -> VmHandle:
        """Start QEMU, run ``on_spawn(pid)``, prove it is up with a monitor answer, then run ``setup`` on it.

        ``keep_monitor`` leaves the QMP session open in ``vm.extra`` for :meth:`complete_restore`.
        """
        log_path = run_dir / "qemu.log"
        with open(log_path, "ab") as log:
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=pass_fds, start_new_session=True,
                )
            except OSError as exc:
                raise VmmError(f"cannot start {self.binary}: {exc}; install QEMU with `bash scripts/setup`") from None
        vm = VmHandle(name=name, run_dir=run_dir, process=process, agent_socket=run_dir / "agent.sock",
                      monitor_socket=run_dir / "qmp.sock", disk=disk)
        if on_spawn is not None:
            try:
                on_spawn(process.pid)
            except Exception as exc:  # e.g. it could not join its cgroup, or it died at once
                await self.kill(vm)
                raise VmmError(f"QEMU for {name} could not be set up ({exc}; exit status {process.returncode}): "
                               f"{_tail(log_path)}") from None
        mark("exec")
        # QEMU creates its sockets before it has parsed every option (and binds before it
        # listens), so only a monitor answer proves the machine was really created.
        try:
            qmp = await self._connect(vm, wait_s=STARTUP_TIMEOUT_S)
            try:
                await qmp.execute("query-status")
                mark("qmp_greeting")
                if setup is not None:
                    await setup(qmp, vm)
            except BaseException:
                await qmp.disconnect()
                raise
        except (VmmError, QMPError) as exc:
            await self.kill(vm)
            raise VmmError(f"QEMU for {name} did not start ({exc}; exit status {process.returncode}): "
                           f"{_tail(log_path)}") from None
        if keep_monitor:
            vm.extra[_KEPT_MONITOR] = qmp
        else:
            await qmp.disconnect()
        return vm

    async def boot(self, name: str, spec: BootSpec, run_dir: Path, base_disk: Path, memory: Path) -> VmHandle:
        disk = run_dir / "disk.qcow2"
        await create_overlay(base_disk, disk, "raw", relative=base_disk.parent.resolve() == run_dir.resolve())
        return await self._start(name, self._argv(spec, run_dir, disk, memory, share=True), run_dir, disk)

    async def _child_overlay_template(self, backing: Path) -> Path:
        """An empty overlay over ``backing``, made once; each child's overlay is a copy of it.

        Copying ~200 KB is far cheaper than running qemu-img for every child of a batch.
        """
        template = backing.with_name(CHILD_OVERLAY_TEMPLATE)
        async with self._template_lock:
            if not template.exists():
                partial = template.with_name(f".{template.name}.partial")
                await create_overlay(backing, partial, "qcow2")
                os.replace(partial, template)
        return template

    async def restore(self, name: str, saved: SavedVm, spec: BootSpec, run_dir: Path,
                      setup: ChildSetup = ChildSetup()) -> VmHandle:
        return await self.complete_restore(await self.prepare_restore(name, saved, spec, run_dir, setup),
                                           setup.on_stage)

    async def prepare_restore(self, name: str, saved: SavedVm, spec: BootSpec, run_dir: Path,
                              setup: ChildSetup = ChildSetup()) -> VmHandle:
        """QEMU started with ``-incoming defer``, the state file inherited, a diff chain's pages laid
        into its RAM mapping, migration capabilities set and its monitor kept open."""
        mark = setup.on_stage or _no_mark
        disk = run_dir / "disk.qcow2"
        template = await self._child_overlay_template(saved.disk)
        await asyncio.to_thread(shutil.copyfile, template, disk)
        mark("overlay")
        state_fd = os.open(saved.state, os.O_RDONLY)

        async def ready(qmp: QMPClient, vm: VmHandle) -> None:
            if saved.layers:  # a diff snapshot: its pages go into the mapping before the state loads
                await asyncio.to_thread(qemu_branch.write_layers, vm.pid, saved.memory,
                                        spec.memory_mib << 20, list(saved.layers))
                mark("layers")
            await qmp.execute("migrate-set-capabilities", _MIGRATION_CAPABILITIES)

        try:
            argv = self._argv(spec, run_dir, disk, saved.memory, share=False, tap_fd=setup.tap_fd)
            fds = (state_fd,) if setup.tap_fd is None else (state_fd, setup.tap_fd)
            vm = await self._start(name, argv + ["-incoming", "defer"], run_dir, disk, pass_fds=fds,
                                   setup=ready, on_spawn=setup.on_spawn, mark=mark, keep_monitor=True)
        finally:
            os.close(state_fd)  # the VMM holds its own copy under the same number
        vm.extra[_STATE_FD] = state_fd
        vm.extra[_NETWORKED] = setup.tap_fd is not None
        return vm

    async def complete_restore(self, vm: VmHandle, on_stage: Callable[[str], None] | None = None) -> VmHandle:
        mark = on_stage or _no_mark
        qmp: QMPClient | None = vm.extra.pop(_KEPT_MONITOR, None)
        if qmp is None:
            raise VmmError(f"{vm.name} was not prepared for a restore (or was completed already)")
        try:
            # The state file is inherited as this fd number; RAM comes from the mapped file.
            await _migrate(qmp, vm, "restoring", "migrate-incoming", {"uri": f"fd:{vm.extra[_STATE_FD]}"})
            mark("state_loaded")
            if not vm.extra[_NETWORKED]:  # the guest sees no carrier: a child without network
                await qmp.execute("set_link", {"name": NIC_ID, "up": False})
            await qmp.execute("cont")  # the parent was paused when saved, so the child loads paused
            mark("cont")
        except (VmmError, QMPError) as exc:
            await qmp.disconnect()
            await self.kill(vm)
            raise VmmError(f"QEMU for {vm.name} could not restore ({exc}; exit status {vm.process.returncode}): "
                           f"{_tail(vm.run_dir / 'qemu.log')}") from None
        await qmp.disconnect()
        return vm

    async def _connect(self, vm: VmHandle, wait_s: float) -> QMPClient:
        """A QMP session, retrying the connection for up to ``wait_s`` while QEMU is still starting."""
        deadline = time.monotonic() + wait_s
        while True:
            client = QMPClient(vm.name)
            try:
                await asyncio.wait_for(client.connect(str(vm.monitor_socket)), timeout=max(0.1, wait_s))
                return client
            except Exception as exc:  # qemu.qmp raises its own ConnectError hierarchy and OSError
                if vm.process.returncode is not None or time.monotonic() > deadline:
                    raise VmmError(f"cannot reach the QEMU monitor of {vm.name}: {exc}") from None
                await asyncio.sleep(0.005)

    @contextlib.asynccontextmanager
    async def _monitor(self, vm: VmHandle, wait_s: float = 10.0) -> AsyncIterator[QMPClient]:
        client = await self._connect(vm, wait_s)
        try:
            yield client
        finally:
            await client.disconnect()

    async def pause(self, vm: VmHandle) -> None:
        async with self._monitor(vm) as qmp:
            await qmp.execute("stop")

    async def resume(self, vm: VmHandle) -> None:
        async with self._monitor(vm) as qmp:
            await qmp.execute("cont")

    async def save(self, vm: VmHandle, state: Path) -> None:
        """Migrate the (paused) VM's device state into ``state`` through a passed file descriptor."""
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            async with self._monitor(vm) as qmp:
                await qmp.execute("stop")
                await qmp.execute("migrate-set-capabilities", _MIGRATION_CAPABILITIES)
                qmp.send_fd_scm(fd)
                await qmp.execute("getfd", {"fdname": "forkd-state"})
                await _migrate(qmp, vm, "saving", "migrate", {"uri": "fd:forkd-state"})
        finally:
            os.close(fd)
        with open(state, "rb+") as written:
            os.fsync(written.fileno())

    async def adopt(self, name: str, process: VmProcess, run_dir: Path, agent_socket: Path, monitor_socket: Path,
                    disk: Path) -> VmHandle:
        vm = VmHandle(name=name, run_dir=run_dir, process=process, agent_socket=agent_socket,
                      monitor_socket=monitor_socket, disk=disk)
        try:
            async with self._monitor(vm, wait_s=ADOPT_MONITOR_TIMEOUT_S) as qmp:
                status = (await qmp.execute("query-status")).get("status")
        except QMPError as exc:
            raise VmmError(f"the QEMU monitor of {name} failed: {exc}") from None
        if status != "running":
            raise VmmError(f"QEMU of {name} is {status}, not running")
        return vm

    async def kill(self, vm: VmHandle) -> None:
        kept: QMPClient | None = vm.extra.pop(_KEPT_MONITOR, None)  # a prepared VMM never completed
        if kept is not None:
            with contextlib.suppress(Exception):
                await kept.disconnect()
        if vm.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                vm.process.kill()
            await vm.process.wait()

    def memory_stats(self, vm: VmHandle) -> MemoryStats:
        return read_memory_stats(vm.pid)

    # branch

    async def capture(self, vm: VmHandle, new_top: Path, stream: Path, live: bool) -> qemu_branch.Capture:
        async with self._monitor(vm) as qmp:
            return await qemu_branch.capture(qmp, vm, new_top, stream, live, _wait_for_migration)

    async def export_disk_layer(self, frozen: Path, dest: Path, backing_name: str) -> None:
        await qemu_branch.freeze_disk_copy(frozen, dest, backing_name)

    async def flatten_disk(self, disk: Path, base_name: str) -> None:
        await qemu_branch.rebase(disk, base_name, "raw", unsafe=False)

    async def reparent(self, spec: BootSpec, stream: Path, disk: Path, memory: Path, state: Path,
                       work_dir: Path) -> None:
        await qemu_branch.reparent(self, spec, stream, disk, memory, state, work_dir, _wait_for_migration)


async def _migrate(qmp: QMPClient, vm: VmHandle, doing: str, command: str, args: dict[str, object]) -> None:
    """Run a migration command and wait for QEMU's MIGRATION event saying it completed (no polling).

    Needs the ``events`` capability (set with ``x-ignore-shared``); a VMM that dies meanwhile ends
    the wait at once, one that stalls ends it after ``SAVE_TIMEOUT_S``.
    """
    listener = EventListener("MIGRATION")
    with qmp.listen(listener):
        await qmp.execute(command, args)
        exited = asyncio.ensure_future(vm.process.wait())
        try:
            deadline = time.monotonic() + SAVE_TIMEOUT_S
            while True:
                event = asyncio.ensure_future(listener.get())
                done, _ = await asyncio.wait({event, exited}, timeout=max(0.0, deadline - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if event not in done:
                    event.cancel()
                    if exited in done:
                        raise VmmError(f"{doing} {vm.name} failed: QEMU exited with status {exited.result()}")
                    raise VmmError(f"{doing} {vm.name} did not finish in {SAVE_TIMEOUT_S:.0f} s")
                status = (event.result().get("data") or {}).get("status")
                if status == "completed":
                    return
                if status in {"failed", "cancelled"}:
                    info = await qmp.execute("query-migrate")
                    raise VmmError(f"{doing} {vm.name} failed: {info.get('error-desc', status)}")
        finally:
            exited.cancel()


async def _wait_for_migration(qmp: QMPClient, name: str, doing: str) -> None:
    """Poll until an outgoing or incoming migration completes (both take milliseconds here)."""
    deadline = time.monotonic() + SAVE_TIMEOUT_S
    while True:
        info = await qmp.execute("query-migrate")
        status = info.get("status")
        if status == "completed":
            return
        if status in {"failed", "cancelled"}:
            raise VmmError(f"{doing} {name} failed: {info.get('error-desc', status)}")
        if time.monotonic() > deadline:
            raise VmmError(f"{doing} {name} did not finish in {SAVE_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.002)


def _tail(path: Path, limit: int = 800) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "(no log)"
    return text[-limit:] or "(empty log)"
