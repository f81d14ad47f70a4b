"""BRANCH for QEMU: capture a running child, turn the capture into an ordinary snapshot, load layers.

A child's RAM is ``share=off`` (its own copy-on-write pages), so ``x-ignore-shared`` would not skip
it: capturing a child streams all its non-zero RAM with the device state. The capture is then
*re-parented*: a short-lived QEMU with RAM ``share=on`` on a new sparse file loads the stream (RAM
pages land in the file, zero pages stay holes), never runs, and saves its device state alone with
``x-ignore-shared`` on. The result is the same three files a baked snapshot has.

Children of diff snapshots map their chain's base memory file and get each layer's pages written
into that mapping through ``/proc/<pid>/mem`` before the device state is loaded: the kernel makes
them private copy-on-write pages, exactly as they were in the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from qemu.qmp import EventListener, QMPClient

from forkd.store.layers import Layer
from forkd.vmm.base import BootSpec, VmHandle, VmmError

# The default migration throttle (32 MiB/s) would stretch a capture over seconds.
_MAX_BANDWIDTH = 64 << 30
_POLL_S = 0.002
LIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Capture:
    pause_s: float  # the guest was not running for this long
    frozen_disk: Path  # the overlay the source wrote until the pause; it now backs the source's new top


def _caps(live: bool) -> dict[str, object]:
    caps = [{"capability": "x-ignore-shared", "state": False},
            {"capability": "background-snapshot", "state": live}]
    return {"capabilities": caps}


async def capture(qmp: QMPClient, vm: VmHandle, new_top: Path, stream: Path, live: bool,
                  wait_for_migration) -> Capture:
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
    except Exception as exc:  # refused before anything was paused
        raise VmmError(f"QEMU refused a {'live ' if live else ''}capture of {vm.name}: {exc}"
                       + ("; live mode needs the memory file on tmpfs or hugetlbfs (userfaultfd "
                          "write-protect), use --mode full or diff" if live else "")) from None
    await qmp.execute("migrate-set-parameters", {"max-bandwidth": _MAX_BANDWIDTH})
    fd = os.open(stream, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    frozen = vm.disk
    runstate = EventListener(("STOP", "RESUME"))
    try:
        with qmp.listen(runstate):
            qmp.send_fd_scm(fd)
            await qmp.execute("getfd", {"fdname": "forkd-branch"})
            try:
                await qmp.execute("stop")
                await _freeze(qmp, vm, new_top)
                await qmp.execute("migrate", {"uri": "fd:forkd-branch"})
                await wait_for_migration(qmp, vm.name, "capturing")
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


async def _freeze(qmp: QMPClient, vm: VmHandle, new_top: Path) -> None:
    """The guest is stopped: its disk overlay becomes read-only history, writes go to ``new_top``."""
    await qmp.execute("blockdev-snapshot-sync", {"device": "root", "snapshot-file": str(new_top),
                                                 "format": "qcow2"})
    vm.disk = new_top


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
    await _qemu_img("rebase", *(["-u"] if unsafe else []), "-f", "qcow2", "-b", backing_name,
                    "-F", backing_format, str(disk))


async def _qemu_img(*args: str) -> None:
    try:
        proc = await asyncio.create_subprocess_exec("qemu-img", *args, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.PIPE)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=120)
    except (OSError, asyncio.TimeoutError) as exc:
        raise VmmError(f"qemu-img {args[0]} failed ({exc!r}); install qemu-utils with `bash scripts/setup`") from None
    if proc.returncode != 0:
        raise VmmError(f"qemu-img {' '.join(args)}: {stderr.decode(errors='replace').strip()}")


def memory_mapping(pid: int, memory: Path, size: int) -> int:
    """Start address of the mapping of ``memory`` in process ``pid``."""
    wanted = str(memory.resolve())
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == wanted:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if end - start == size and int(fields[2], 16) == 0:
                    return start
    raise VmmError(f"guest RAM mapping of {memory} not found in process {pid}")


def write_layers(pid: int, memory: Path, size: int, layers: list[Layer]) -> int:
    """Lay each layer's pages (base first) over the guest RAM of process ``pid``; bytes written."""
    address = memory_mapping(pid, memory, size)
    written = 0
    mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        for layer in layers:
            src = os.open(layer.path, os.O_RDONLY)
            try:
                for guest_offset, position, length in layer.runs():
                    if guest_offset + length > size:
                        raise VmmError(f"layer {layer.path} holds a page beyond guest RAM ({guest_offset:#x})")
                    data = os.pread(src, length, position)
                    if len(data) != length or os.pwrite(mem, data, address + guest_offset) != length:
                        raise VmmError(f"could not lay {layer.path} over the RAM of process {pid}")
                    written += length
            finally:
                os.close(src)
    finally:
        os.close(mem)
    return written


async def reparent(vmm, spec: BootSpec, stream: Path, disk: Path, memory: Path, state: Path,
                   work_dir: Path, wait_for_migration) -> None:
    """Load a capture into RAM backed by ``memory`` (share=on) and save the device state alone."""
    work_dir.mkdir()
    scratch = work_dir / "scratch.qcow2"  # the VM never runs, but QEMU opens its disk read-write
    try:
        await _qemu_img("create", "-q", "-f", "qcow2", "-b", str(disk.resolve()), "-F", "qcow2", str(scratch))
        stream_fd = os.open(stream, os.O_RDONLY)
        state_fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

        async def load_and_save(qmp: QMPClient, _vm: VmHandle) -> None:
            await qmp.execute("migrate-set-capabilities", {"capabilities": [
                {"capability": "x-ignore-shared", "state": False}]})
            await qmp.execute("migrate-incoming", {"uri": f"fd:{stream_fd}"})
            await wait_for_migration(qmp, "re-parent", "loading the capture")
            await qmp.execute("migrate-set-capabilities", {"capabilities": [
                {"capability": "x-ignore-shared", "state": True}]})
            qmp.send_fd_scm(state_fd)
            await qmp.execute("getfd", {"fdname": "forkd-state"})
            await qmp.execute("migrate", {"uri": "fd:forkd-state"})
            await wait_for_migration(qmp, "re-parent", "saving device state")

        try:
            # -S: the capture's runstate may say "running"; this VM must never run.
            argv = vmm._argv(spec, work_dir, scratch, memory, share=True, boot=False) + ["-incoming", "defer", "-S"]
            vm = await vmm._start("re-parent", argv, work_dir, scratch, pass_fds=(stream_fd,), setup=load_and_save)
            await vmm.kill(vm)
        finally:
            os.close(stream_fd)
            os.close(state_fd)
        with open(state, "rb+") as written:
            os.fsync(written.fileno())
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
