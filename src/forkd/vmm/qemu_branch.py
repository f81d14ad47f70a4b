"""BRANCH for QEMU: capture a running child, turn the capture into an ordinary snapshot, load layers.

A child's RAM is ``share=off`` (its own copy-on-write pages), so ``x-ignore-shared`` would not skip
it: capturing a child streams all its non-zero RAM with the device state. The capture is then
*re-parented*: a short-lived QEMU with RAM ``share=on`` on a new sparse file loads the stream (RAM
pages land in the file, zero pages stay holes), never runs, and saves its device state alone with
``x-ignore-shared`` on. The result is the same three files a baked snapshot has.

This is the QEMU implementation of the optional :class:`forkd.vmm.branching.Branching` capability;
it drives QEMU only through ``qemu_machine`` (the core backend's process and monitor layer).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path

from qemu.qmp import EventListener, QMPError

from forkd.vmm.base import BootSpec, VmHandle, VmmError
from forkd.vmm.branching import Capture
from forkd.vmm.qemu_machine import DISK_KEY, Monitor, QemuMachine, disk_of, kill, monitor, qemu_img

# The default migration throttle (32 MiB/s) would stretch a capture over seconds.
_MAX_BANDWIDTH = 64 << 30
_POLL_S = 0.002
LIVE_TIMEOUT_S = 300.0


class QemuBranching:
    """BRANCH for :class:`forkd.vmm.qemu.QemuVmm`, sharing its :class:`QemuMachine`."""

    def __init__(self, machine: QemuMachine) -> None:
        self.machine = machine

    async def capture(self, vm: VmHandle, new_top: Path, stream: Path, live: bool) -> Capture:
        async with monitor(vm) as qmp:
            return await capture(qmp, vm, new_top, stream, live)

    async def export_disk_layer(self, frozen: Path, dest: Path, backing_name: str) -> None:
        await freeze_disk_copy(frozen, dest, backing_name)

    async def flatten_disk(self, disk: Path, base_name: str) -> None:
        await rebase(disk, base_name, "raw", unsafe=False)

    async def reparent(self, spec: BootSpec, stream: Path, disk: Path, memory: Path, state: Path,
                       work_dir: Path) -> None:
        await reparent(self.machine, spec, stream, disk, memory, state, work_dir)


def _caps(live: bool) -> dict[str, object]:
    caps = [{"capability": "x-ignore-shared", "state": False},
            {"capability": "background-snapshot", "state": live}]
    return {"capabilities": caps}


async def capture(qmp: Monitor, vm: VmHandle, new_top: Path, stream: Path, live: bool) -> Capture:
    """Stop the guest, freeze the disk (the source goes on in ``new_top``), stream RAM and devices, resume.

    Disk, memory and vCPU state are all taken while the guest is stopped, so they are from one
    instant. Plain mode copies all RAM while stopped (~150 MB for a 1 GiB guest). ``live`` lets
    QEMU's ``background-snapshot`` resume the guest after the device state and copy RAM under
    userfaultfd write protection; QEMU 7.2 write-protects all of guest RAM before resuming, so that
    pause is longer, not shorter. A pre-copy migration (guest running, ``pause-before-switchover``
    to freeze the disk at the switchover) paused only 20-40 ms, but 1 of 5 captures restored into a
    guest that panicked on corrupt memory under TCG: its dirty tracking is not trusted here.
    The pause is read from QEMU's own STOP and RESUME event timestamps.
    """
    try:
        await qmp.execute("migrate-set-capabilities", _caps(live))
    except QMPError as exc:  # refused before anything was paused
        raise VmmError(f"QEMU refused a {'live ' if live else ''}capture of {vm.name}: {exc}"
                       + ("; live mode needs the memory file on tmpfs or hugetlbfs (userfaultfd "
                          "write-protect) and, as the VMM runs without CAP_SYS_PTRACE, the sysctl "
                          "vm.unprivileged_userfaultfd = 1; use --mode full or diff" if live else "")) from None
    await qmp.execute("migrate-set-parameters", {"max-bandwidth": _MAX_BANDWIDTH})
    fd = os.open(stream, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    frozen = disk_of(vm)
    runstate = EventListener(("STOP", "RESUME"))
    try:
        with qmp.listen(runstate):
            qmp.send_fd_scm(fd)
            await qmp.execute("getfd", {"fdname": "forkd-branch"})
            try:
                await qmp.execute("stop")
                await _freeze(qmp, vm, new_top)
                await qmp.execute("migrate", {"uri": "fd:forkd-branch"})
                await qmp.wait_for_migration("capturing")
            except BaseException:
                with contextlib.suppress(Exception):
                    await qmp.execute("migrate_cancel")
                raise
            finally:
                if not (await qmp.execute("query-status"))["running"]:
                    await qmp.execute("cont")
            pause_s = await _pause_window(runstate)
    finally:
        os.close(fd)
    return Capture(pause_s=pause_s, frozen_disk=frozen)


async def _freeze(qmp: Monitor, vm: VmHandle, new_top: Path) -> None:
    """The guest is stopped: its disk overlay becomes read-only history, writes go to ``new_top``."""
    await qmp.execute("blockdev-snapshot-sync", {"device": "root", "snapshot-file": str(new_top),
                                                 "format": "qcow2"})
    vm.state[DISK_KEY] = str(new_top)


async def _pause_window(runstate: EventListener) -> float:
    """Seconds from the first STOP to the last RESUME, by QEMU's event timestamps."""
    events = runstate.clear()
    if not any(e["event"] == "RESUME" for e in events):
        events.append(await asyncio.wait_for(runstate.get(), timeout=5))
    def stamps(name: str) -> list[float]:
        return [e["timestamp"]["seconds"] + e["timestamp"]["microseconds"] / 1e6 for e in events if e["event"] == name]

    return max(stamps("RESUME")) - min(stamps("STOP"))


async def freeze_disk_copy(frozen: Path, dest: Path, backing_name: str) -> None:
    """Copy the frozen overlay into the snapshot and point it at its parent's disk by relative name.

    The source still reads ``frozen`` as a backing file (so QEMU holds a lock on it): the snapshot
    gets its own copy, which holds only what the source wrote since its last branch.
    """
    await asyncio.to_thread(shutil.copyfile, frozen, dest)
    await rebase(dest, backing_name, "qcow2", unsafe=True)


async def rebase(disk: Path, backing_name: str, backing_format: str, unsafe: bool) -> None:
    """Point ``disk`` at another backing file; ``unsafe=False`` first copies in what the two differ in."""
    await qemu_img("rebase", *(["-u"] if unsafe else []), "-f", "qcow2", "-b", backing_name,
                    "-F", backing_format, str(disk))


async def reparent(machine: QemuMachine, spec: BootSpec, stream: Path, disk: Path, memory: Path, state: Path,
                   work_dir: Path) -> None:
    """Load a capture into RAM backed by ``memory`` (share=on) and save the device state alone."""
    work_dir.mkdir()
    scratch = work_dir / "scratch.qcow2"  # the VM never runs, but QEMU opens its disk read-write
    try:
        await qemu_img("create", "-q", "-f", "qcow2", "-b", str(disk.resolve()), "-F", "qcow2", str(scratch))
        stream_fd = os.open(stream, os.O_RDONLY)
        state_fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

        async def load_and_save(qmp: Monitor) -> None:
            await qmp.execute("migrate-set-capabilities", {"capabilities": [
                {"capability": "x-ignore-shared", "state": False}]})
            await qmp.execute("migrate-incoming", {"uri": f"fd:{stream_fd}"})
            await qmp.wait_for_migration("loading the capture")
            await qmp.execute("migrate-set-capabilities", {"capabilities": [
                {"capability": "x-ignore-shared", "state": True}]})
            qmp.send_fd_scm(state_fd)
            await qmp.execute("getfd", {"fdname": "forkd-state"})
            await qmp.execute("migrate", {"uri": "fd:forkd-state"})
            await qmp.wait_for_migration("saving device state")

        try:
            # -S: the capture's runstate may say "running"; this VM must never run.
            argv = machine.argv(spec, work_dir, scratch, memory, share=True, boot=False) + ["-incoming", "defer", "-S"]
            vm = await machine.start("re-parent", argv, work_dir, scratch, pass_fds=(stream_fd,), setup=load_and_save)
            await kill(vm)
        finally:
            os.close(stream_fd)
            os.close(state_fd)
        with open(state, "rb+") as written:
            os.fsync(written.fileno())
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
