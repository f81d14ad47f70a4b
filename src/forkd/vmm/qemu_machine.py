"""One QEMU process: its command line, how it is started and confined, and a bounded QMP monitor.

Shared by the core backend (``qemu.py``) and the branching capability (``qemu_branch.py``), so
neither reaches into the other. Every QMP command has a deadline: a VMM that accepts its monitor
and then stalls (hung, or stopped with SIGSTOP) is killed and reported, never waited on forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import re
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, Any

from qemu.qmp import EventListener, QMPClient, QMPError

from forkd.guest import netconf
from forkd.guest.protocol import AGENT_PORT_NAME
from forkd.vmm.accel import KVM_DEVICE, accel_option
from forkd.vmm.base import CONSOLE_LOG, BootSpec, VmHandle, VmmError, VmProcess, no_stage_marks
from forkd.vmm.jail import HostFile, Jail
from forkd.vmm.qemu_exit import SHUTDOWN_TRACE, VMM_LOG, QemuVm, tail
from forkd.vmm.qemu_layout import MICROVM_LAYOUT, Q35_LAYOUT, host_tsc_khz, layout_of, microvm_identity

log = logging.getLogger("forkd.vmm")

QEMU_BINARY = "qemu-system-x86_64"
MACHINE_ALIAS = "q35"
STARTUP_TIMEOUT_S = 20.0
QMP_TIMEOUT_S = 30.0  # one monitor command; QEMU answers in milliseconds unless it is stalled
MIGRATION_TIMEOUT_S = 120.0
# TCG translation buffer per VMM. Measured per child at idle (reseed + numpy eval + one command,
# bench/child_cost.py, docs/benchmarks.md): a child's code needs ~31 MiB of translations, so 16 MiB
# flushes 5 times and retranslates (1.19 CPU-s per child) where 32 MiB flushes once (0.67 CPU-s),
# for +17 MiB Private_Dirty per child; 48 and 64 MiB fill no further. On 2 cores CPU is what limits
# a fan-out, so the default favours it; `tcg_tb_size_mib` in the daemon's config trades it back.
TCG_TB_SIZE_MIB = 32
NIC_ID = "nic0"
PR_SET_THP_DISABLE = 41  # prctl(2)
#: An inert NIC backend: a hub with this one port, so frames go nowhere. Backends are not
#: migrated, so a parent baked on it can restore onto a tap. The tap is opened without vnet headers,
#: so the offload features the guest negotiated are the same whichever backend a child gets.
_INERT_NETDEV = "hubport,id=net0,hubid=0"
#: QEMU's seccomp filter: no obsolete syscalls, no setuid/setgid/capset, no fork/exec, no
#: scheduler or resource-limit changes. Migration to an fd and a BRANCH's device-state file need none.
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
#: A jailed QEMU drops to its own uid itself (``-runas``), after QEMU has installed its filter, so
#: set*uid must stay allowed; once it runs as that uid it has no capability to use them with.
SECCOMP_JAILED = SECCOMP.replace("elevateprivileges=deny", "elevateprivileges=allow")
#: What a jailed QEMU keeps until it drops to its uid, before the guest runs or any state loads:
#: QEMU 7.2 opens a child's memory file (root's, mode 0400) read-write even for its private
#: mapping (``dac_override``), and ``-runas`` sets its uid, gid and groups (``setuid``, ``setgid``).
JAILED_START_CAPS = ("dac_override", "setuid", "setgid")

#: The guest CPU under TCG: a named, versioned model (its CPUID never moves with a QEMU release,
#: unlike ``max``) that QEMU 7.2's TCG implements completely, minus cx16. ``qemu64`` claims to be
#: a family-15 AMD, so OpenBLAS picks its Opteron kernels, which execute the 3DNow! ``femms``
#: (``dgemm_otcopy_OPTERON_SSE3``) that qemu64 does not offer: SIGILL. ``max`` is the same AMD
#: family 15 (and changes with every QEMU). Westmere is Intel (OpenBLAS: Nehalem kernels) with
#: SSSE3, SSE4.1/4.2, POPCNT, AES-NI and PCLMULQDQ; its AVX-capable successors are not fully
#: implemented by 7.2's TCG. cx16 stays off: QEMU 7.2's TCG corrupted flags in the guest kernel's
#: SLUB cmpxchg16b fast path (4 of 4 parents booted in parallel double-faulted; 0 of 4 without).
TCG_CPU_MODEL = "Westmere-v1,-cx16"


def cpu_model(accelerator: str) -> str:
    """The host's CPU under KVM; under TCG the model above."""
    return "host" if accelerator == "kvm" else TCG_CPU_MODEL


def disable_huge_pages() -> None:
    """Transparent huge pages off for this process and every process it starts from now on (the flag
    is inherited and survives exec, so every VMM has it; the daemon's own memory is not advised for them).

    QEMU advises huge pages for its translation buffer and its RAM blocks, so one byte written makes
    2 MiB of a child's memory private; with the flag off it is 4 KiB. Measured (bench/child_cost.py,
    docs/benchmarks.md): 2-3.4 MiB less Private_Dirty per child.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        log.warning("cannot turn transparent huge pages off for VMMs (%s): each child keeps 2-3 MiB more "
                    "private memory", os.strerror(ctypes.get_errno()))


class MonitorStalled(VmmError):
    """A QMP command got no answer in time; the VMM has been killed."""


@functools.cache
def qemu_version(binary: str) -> str:
    """``7.2.22`` from ``QEMU emulator version 7.2.22 (Debian ...)``."""
    match = re.search(r"version (\S+)", _run(binary, "--version"))
    if match is None:
        raise VmmError(f"cannot tell the version of {binary}; install QEMU with `bash scripts/setup`")
    return match.group(1)


@functools.cache
def machine_type(binary: str, alias: str = MACHINE_ALIAS) -> str:
    """The versioned machine an alias stands for in this QEMU (``q35`` → ``pc-q35-7.2``).

    Device state only loads into the same versioned machine; recording the alias would let a QEMU
    upgrade move it under existing snapshots. Pinning the versioned name keeps old snapshots loading
    on a newer QEMU (which keeps the old machine types) and names the difference when it does not.
    """
    for line in _run(binary, "-machine", "help").splitlines():
        fields = line.split()
        if fields and fields[0] == alias:
            match = re.search(r"\(alias of (\S+)\)", line)
            return match.group(1) if match else alias
    raise VmmError(f"{binary} has no machine {alias!r}; install qemu-system-x86 with `bash scripts/setup`")


@functools.cache
def has_machine(binary: str, name: str) -> bool:
    """Whether this QEMU has the machine type ``name`` (an x86 build without microvm has not)."""
    return any(line.split()[:1] == [name] for line in _run(binary, "-machine", "help").splitlines())


def _run(binary: str, *args: str) -> str:
    try:
        return subprocess.run([binary, *args], capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise VmmError(f"cannot run {binary} ({exc}); install QEMU with `bash scripts/setup`") from None


# What a QEMU VmHandle keeps in its backend state (persisted with the sandbox record).
MONITOR_KEY, DISK_KEY = "monitor_socket", "disk"
#: What a QEMU leaves in its run directory that nothing needs once it has stopped.
AGENT_SOCKET, MONITOR_SOCKET = "agent.sock", "qmp.sock"
RUN_LEFTOVERS = (AGENT_SOCKET, MONITOR_SOCKET)
MEMORY_KEY = "memory"  # the memory file a child maps (share=off): its private pages are what it changed


def disk_of(vm: VmHandle) -> Path:
    """The disk the VM writes now (BRANCH moves it to a new top)."""
    return Path(vm.state[DISK_KEY])


class Monitor:
    """A connected QMP session whose every command is bounded; a stall kills the VMM."""

    def __init__(self, client: QMPClient, vm: VmHandle, timeout_s: float) -> None:
        self._client = client
        self.vm = vm
        self.timeout_s = timeout_s

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout_s: float | None = None) -> Any:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):  # not wait_for: on 3.11 it can swallow the caller's cancellation
                return await self._client.execute(command, arguments)
        except TimeoutError:
            await kill(self.vm)
            raise MonitorStalled(f"the QEMU monitor of {self.vm.name} did not answer {command!r} within "
                                 f"{limit:.0f} s; the VMM was stalled and has been killed") from None

    def send_fd_scm(self, fd: int) -> None:
        self._client.send_fd_scm(fd)

    async def add_fds(self, fds: list[int], opaque: str) -> str:
        """Copies of ``fds`` in a new fd set of the VMM; the name QEMU opens them by (``/dev/fdset/N``
        gives whichever has the access mode asked for)."""
        fdset: int | None = None
        for fd in fds:
            self.send_fd_scm(fd)
            added = await self.execute("add-fd", {"opaque": opaque} if fdset is None
                                       else {"opaque": opaque, "fdset-id": fdset})
            fdset = added["fdset-id"]
        return f"/dev/fdset/{fdset}"

    def listen(self, listener: EventListener) -> contextlib.AbstractContextManager[Any]:
        return self._client.listen(listener)

    async def migrate(self, doing: str, command: str, arguments: dict[str, Any],
                      timeout_s: float = MIGRATION_TIMEOUT_S) -> None:
        """Run a migration command and wait for QEMU's MIGRATION event saying it completed (no polling).

        Needs the ``events`` migration capability. A VMM that dies meanwhile ends the wait at once;
        one that never finishes is killed after ``timeout_s``.
        """
        listener = EventListener("MIGRATION")
        with self.listen(listener):
            await self.execute(command, arguments)
            exited = asyncio.ensure_future(self.vm.process.wait())
            deadline = time.monotonic() + timeout_s
            try:
                while True:
                    event = asyncio.ensure_future(listener.get())
                    done, _ = await asyncio.wait({event, exited}, timeout=max(0.0, deadline - time.monotonic()),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if event not in done:
                        event.cancel()
                        if exited in done:
                            raise VmmError(f"{doing} {self.vm.name} failed: QEMU exited with status "
                                           f"{exited.result()}")
                        await kill(self.vm)
                        raise MonitorStalled(f"{doing} {self.vm.name} did not finish in {timeout_s:.0f} s; "
                                             "the VMM has been killed")
                    status = (event.result().get("data") or {}).get("status")
                    if status == "completed":
                        return
                    if status in {"failed", "cancelled"}:
                        info = await self.execute("query-migrate")
                        raise VmmError(f"{doing} {self.vm.name} failed: {info.get('error-desc', status)}")
            finally:
                exited.cancel()


async def kill(vm: VmHandle) -> None:
    if vm.process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            vm.process.kill()
        await vm.process.wait()


@contextlib.asynccontextmanager
async def monitor(vm: VmHandle, wait_s: float = 10.0, timeout_s: float = QMP_TIMEOUT_S) -> AsyncIterator[Monitor]:
    """A QMP session, retrying the connection for up to ``wait_s`` while QEMU is still starting.

    The connect includes QMP's greeting and capability negotiation, so a VMM that accepts the
    socket and never speaks is bounded by ``wait_s`` too (and killed: it is not a VMM we can use).
    """
    deadline = time.monotonic() + wait_s
    while True:
        client = QMPClient(vm.name)
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):  # not wait_for: see execute
                await client.connect(vm.state[MONITOR_KEY])
            break
        except TimeoutError:
            await _abandon(client)
            await kill(vm)
            raise MonitorStalled(f"the QEMU monitor of {vm.name} accepted but did not answer within {wait_s:.0f} s; "
                                 "the VMM was stalled and has been killed") from None
        except Exception as exc:  # qemu.qmp raises its own ConnectError hierarchy and OSError
            if vm.process.returncode is not None or time.monotonic() > deadline:
                raise VmmError(f"cannot reach the QEMU monitor of {vm.name}: {exc}") from None
            await asyncio.sleep(0.005)
    try:
        yield Monitor(client, vm, timeout_s)
    finally:
        await _abandon(client)


async def _abandon(client: QMPClient) -> None:
    """Disconnect, bounded: a stalled peer must not hold the caller."""
    with contextlib.suppress(Exception, asyncio.TimeoutError):
        await asyncio.wait_for(client.disconnect(), timeout=2.0)


class QemuMachine:
    """How forkd runs ``qemu-system-x86_64``: one machine definition for parents and children."""

    def __init__(self, binary: str, accelerator: str, cpu_model: str, jail: Jail | None = None,
                 tb_size_mib: int = TCG_TB_SIZE_MIB, huge_pages: bool = False) -> None:
        self.binary = binary
        if not huge_pages:
            disable_huge_pages()
        self.tb_size_mib = tb_size_mib
        self.accelerator = accelerator
        self.cpu_model = cpu_model
        self.jail = jail  # None: the operator opted out of confinement; VMMs run as root

    @property
    def machine(self) -> str:
        """The pinned identity of the default machine (q35's versioned type)."""
        return machine_type(self.binary)

    def identity_of(self, machine: str) -> str:
        """What a snapshot's identity records for ``machine``: q35's versioned type (``pc-q35-7.2``);
        microvm, which QEMU does not version, with forkd's version of its layout (``microvm-forkd1``)."""
        return machine_type(self.binary) if layout_of(machine) is Q35_LAYOUT else microvm_identity()

    def machines(self) -> tuple[str, ...]:
        """The machine types this QEMU has, q35 first (``-machine help``, cached)."""
        return (Q35_LAYOUT.name, *(name for name in (MICROVM_LAYOUT.name,) if has_machine(self.binary, name)))

    def warm_up(self) -> None:
        """Everything cached once per daemon that :meth:`argv` and :meth:`start` would otherwise do for the
        first VMM, on the caller's thread: QEMU run for its version and machines, the host's TSC rate
        measured (~50 ms) when microvm is offered, the jail checked and its uids learned."""
        qemu_version(self.binary)
        if MICROVM_LAYOUT.name in self.machines():
            host_tsc_khz()
        if self.jail is not None:
            self.jail.warm_up()

    def argv(self, spec: BootSpec, run_dir: Path, disk: Path, memory: Path, share: bool,
             tap_fd: int | None = None, boot: bool | None = None, tb_size_mib: int | None = None) -> list[str]:
        """The machine; parent and children must agree on every device for state to load.

        Only a parent (``share=True``) is given the kernel: a child's kernel is already in the RAM
        it maps, and QEMU would otherwise keep a private ~14 MB copy of vmlinuz and initrd per child.
        ``tb_size_mib`` raises TCG's translation buffer for this VMM above the configured size (the
        buffer is not part of the saved state, so it may differ between a parent and its children).
        """
        layout = layout_of(spec.machine)
        kernel = (["-kernel", str(spec.kernel), "-initrd", str(spec.initrd),
                   "-append", " ".join([spec.cmdline, *layout.kernel_args()])] if _with_kernel(share, boot) else [])
        machine = self.machine if layout is Q35_LAYOUT else layout.name
        tb_size = max(self.tb_size_mib, tb_size_mib or 0)
        accel = accel_option(self.accelerator, spec.vcpus, tb_size, qemu_version(self.binary))
        netdev = _INERT_NETDEV if tap_fd is None else f"tap,id=net0,fd={tap_fd},vhost=off"
        return [
            self.binary,
            "-nodefaults", "-no-user-config", "-nographic", "-display", "none",
            "-no-reboot",  # a guest panic (panic=-1) ends the VMM, so it is noticed, not rebooted
            "-trace", SHUTDOWN_TRACE,
            "-sandbox", SECCOMP,
            "-machine", ",".join([machine, "memory-backend=ram", *layout.options]),
            "-accel", accel,
            "-cpu", self.cpu_model,
            "-smp", str(spec.vcpus),
            "-m", f"{spec.memory_mib}M",
            "-object",
            f"memory-backend-file,id=ram,size={spec.memory_mib}M,mem-path={memory},share={'on' if share else 'off'}",
            *kernel,
            # A host disk that fills (or fails) gives the guest I/O errors; QEMU's default (werror=enospc)
            # would pause the VM, and its agent would stop answering until recovery killed it.
            "-drive", f"file={disk},format=qcow2,if=none,id=root,cache=writeback,discard=unmap,"
                      "werror=report,rerror=report",
            "-device", f"{layout.virtio('blk')},drive=root,id=rootdisk",
            "-netdev", netdev,
            "-device", f"{layout.virtio('net')},netdev=net0,mac={netconf.GUEST_MAC},id={NIC_ID}",
            "-device", f"{layout.virtio('serial')},id=vser",
            "-chardev", f"socket,id=agent,path={run_dir / AGENT_SOCKET},server=on,wait=off",
            "-device", f"virtserialport,chardev=agent,name={AGENT_PORT_NAME},id=agentport",
            # A new generation id on every restore tells the guest kernel to reseed its RNG.
            "-device", f"vmgenid,guid={uuid.uuid4()},id=vmgenid",
            # Appended to, so the runtime can cut it while QEMU writes (VmHandle.bound_logs).
            "-chardev", f"file,id=console,path={run_dir / CONSOLE_LOG},append=on",
            "-serial", "chardev:console",
            "-qmp", f"unix:{run_dir / MONITOR_SOCKET},server=on,wait=off",
        ]

    def host_files(self, spec: BootSpec, backing: Sequence[Path], memory: Path, share: bool,
                   boot: bool | None = None) -> tuple[HostFile, ...]:
        """What :meth:`argv` has QEMU open on the host besides its run directory (its disk, sockets and logs),
        for its jail to show it: the disk's ``backing`` chain, the kernel and initrd it boots, the memory
        file (read-write: QEMU 7.2 opens it so even for a private mapping) and /dev/kvm when it runs on KVM."""
        kernel = (HostFile(spec.kernel), HostFile(spec.initrd)) if _with_kernel(share, boot) else ()
        kvm = (HostFile(KVM_DEVICE, writable=True),) if self.accelerator == "kvm" else ()
        return (*(HostFile(layer) for layer in backing), *kernel, HostFile(memory, writable=True), *kvm)

    async def start(self, name: str, argv: list[str], run_dir: Path, disk: Path, pass_fds: tuple[int, ...] = (),
                    files: Sequence[HostFile] = (),
                    setup: Callable[[Monitor], Awaitable[object]] | None = None,
                    on_spawn: Callable[[int], None] | None = None,
                    on_stage: Callable[[str], None] = no_stage_marks) -> VmHandle:
        """Start QEMU (jailed, seeing its run directory and ``files``), run ``on_spawn(pid)``, prove it is up
        with a monitor answer, then run ``setup`` on it.

        Marks ``exec`` (process started and set up) and ``qmp_greeting`` (the monitor answered).
        """
        log_path = run_dir / VMM_LOG
        with open(log_path, "ab") as log:
            process = await self._spawn(argv, run_dir, log, pass_fds, files)
        vm = QemuVm(name=name, run_dir=run_dir, process=process, agent_socket=run_dir / AGENT_SOCKET,
                    state={MONITOR_KEY: str(run_dir / MONITOR_SOCKET), DISK_KEY: str(disk)})
        if on_spawn is not None:
            try:
                on_spawn(process.pid)
            except Exception as exc:  # e.g. it could not join its cgroup, or it died at once
                await kill(vm)
                raise VmmError(f"QEMU for {name} could not be set up ({exc}; exit status {process.returncode}): "
                               f"{tail(log_path)}") from None
        on_stage("exec")
        # QEMU creates its sockets before it has parsed every option (and binds before it
        # listens), so only a monitor answer proves the machine was really created.
        try:
            async with monitor(vm, wait_s=STARTUP_TIMEOUT_S) as qmp:
                await qmp.execute("query-status")
                on_stage("qmp_greeting")
                if setup is not None:
                    await setup(qmp)
        except (VmmError, QMPError) as exc:
            await kill(vm)
            raise VmmError(f"QEMU for {name} did not start ({exc}; exit status {process.returncode}): "
                           f"{tail(log_path)}") from None
        except BaseException:
            await kill(vm)
            raise
        return vm

    async def _spawn(self, argv: list[str], run_dir: Path, log: IO[bytes], pass_fds: tuple[int, ...],
                     files: Sequence[HostFile]) -> VmProcess:
        """QEMU in its jail (its own uid, namespaces and rlimits), or as root when the operator opted out."""
        try:
            if self.jail is not None:
                return await self.jail.spawn(functools.partial(jailed_argv, argv), JAILED_START_CAPS, run_dir,
                                             log, pass_fds, files)
            return await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                        pass_fds=pass_fds, start_new_session=True)
        except OSError as exc:
            raise VmmError(f"cannot start {self.binary}: {exc}; install QEMU with `bash scripts/setup`") from None


def _with_kernel(share: bool, boot: bool | None) -> bool:
    """Whether a VMM boots the kernel: a parent (shared memory) unless told otherwise."""
    return share if boot is None else boot


def jailed_argv(argv: list[str], uid: int) -> list[str]:
    """``argv`` for a QEMU that drops to ``uid`` (and the gid of that number) once it has opened every
    file on its command line and bound its sockets, before its main loop: before the guest runs and
    before any monitor command (so any device state) is read."""
    jailed = list(argv)
    jailed[jailed.index("-sandbox") + 1] = SECCOMP_JAILED
    # -drive defaults to auto-read-only=on: when a disk stops being written (a migration's end, a top that
    # BRANCH freezes) QEMU reopens it read-only *by name*, which its uid may not reach. Off: it keeps its fd.
    for at, arg in enumerate(argv[:-1]):
        if arg == "-drive":
            jailed[at + 1] = f"{argv[at + 1]},auto-read-only=off"
    return [*jailed, "-runas", f"{uid}:{uid}"]
