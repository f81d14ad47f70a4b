"""BRANCH for QEMU: stop a running child, take its disk, device state and private pages, resume it.

A child maps its snapshot's memory file ``share=off``: the pages it wrote are its private
copy-on-write pages, and they are all of what it changed. So a capture never streams RAM through
QEMU: while the guest is stopped, the disk moves to a new overlay created beforehand
(``blockdev-snapshot``), ``xen-save-devices-state`` writes the device state alone (despite its
name it is generic QEMU: every device section, no RAM section), and the private pages are read
from the host (:func:`forkd.vmm.guest_ram.read_private`). Then ``cont``.

That device state file has no configuration section, so a child loading it is started with
``-global migration.send-configuration=off`` (:data:`DEVICE_STATE`); and the state says "running",
so children start with ``-S`` and run only on the restore's own ``cont``.

This is the QEMU implementation of the optional :class:`forkd.vmm.branching.Branching` capability;
it drives QEMU only through ``qemu_machine`` (the core backend's process and monitor layer).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from qemu.qmp import QMPError

from forkd.vmm import guest_ram, procmem
from forkd.vmm.base import Pages, VmHandle, VmmError
from forkd.vmm.branching import Capture
from forkd.vmm.qemu_disk import qemu_img
from forkd.vmm.qemu_machine import DISK_KEY, MEMORY_KEY, Monitor, disk_of, monitor

#: ``SavedVm.state_format`` of a state written by ``xen-save-devices-state``.
DEVICE_STATE = "qemu-devices"
#: What a child loading a :data:`DEVICE_STATE` file needs on its command line.
DEVICE_STATE_ARGS = ("-global", "migration.send-configuration=off")
ROOT_DRIVE = "root"


class QemuBranching:
    """BRANCH for :class:`forkd.vmm.qemu.QemuVmm`."""

    async def capture(self, vm: VmHandle, memory_bytes: int, state: Path,
                      live: bool, mark: Callable[[str], None]) -> Capture:
        if MEMORY_KEY not in vm.state:
            raise VmmError(f"{vm.name} was started by an older forkd that did not record its memory file; "
                           "fork a new sandbox to branch from")
        memory = Path(vm.state[MEMORY_KEY])
        new_top = vm.run_dir / f"disk-{secrets.token_hex(4)}.qcow2"  # the source's disk from the pause on
        try:
            async with monitor(vm) as qmp, _passed_file(qmp, state) as state_name:
                return await capture(qmp, vm, memory, memory_bytes, new_top, state, state_name, live, mark)
        except QMPError as exc:
            raise VmmError(f"capturing {vm.name} failed: {exc}") from None


async def capture(qmp: Monitor, vm: VmHandle, memory: Path, memory_bytes: int, new_top: Path, state: Path,
                  state_name: str, live: bool, mark: Callable[[str], None]) -> Capture:
    """Disk, device state and memory all from one stopped instant; the pause holds only QMP commands
    and the copy of the guest's private pages (a memcpy of what it changed). QEMU writes the device
    state to ``state_name`` (``state`` passed as a descriptor: a jailed VMM may not create files)."""
    precopy: Pages | None = None
    if live and procmem.soft_dirty_supported():
        procmem.clear_soft_dirty(vm.pid)  # pages written from now on are marked soft-dirty
        precopy = await asyncio.to_thread(guest_ram.read_private, vm.pid, memory, memory_bytes)
        mark("precopy")
    # The copy's destination is faulted in now, while the guest runs, not during the pause; the
    # overlay is made meanwhile (a qemu-img process and a monitor command: little CPU of the daemon's).
    frozen = disk_of(vm)
    buffer, overlay = await _prepare(qmp, vm, memory, memory_bytes, frozen, new_top, mark)
    stopped_at = time.monotonic()
    switched = False
    try:
        await qmp.execute("stop")
        mark("stop")
        await qmp.execute("blockdev-snapshot", {"node": ROOT_DRIVE, "overlay": overlay})
        switched = True
        vm.state[DISK_KEY] = str(new_top)
        mark("disk_switched")
        # live=false: do not hand the disk over (inactivate it); this VM goes on using it.
        await qmp.execute("xen-save-devices-state", {"filename": state_name, "live": False})
        mark("device_state_saved")
        pages = await asyncio.to_thread(guest_ram.read_private, vm.pid, memory, memory_bytes, precopy, buffer, mark)
        mark("pages_read")
    finally:
        try:
            if not switched:
                with contextlib.suppress(QMPError):
                    await qmp.execute("blockdev-del", {"node-name": overlay})
                new_top.unlink(missing_ok=True)
        finally:
            await qmp.execute("cont")
            pause_s = time.monotonic() - stopped_at
            mark("cont")
    await asyncio.to_thread(_fsync, state)
    return Capture(pause_s=pause_s, frozen_disk=frozen, pages=pages, state_format=DEVICE_STATE,
                   precopied=precopy is not None)


async def _prepare(qmp: Monitor, vm: VmHandle, memory: Path, memory_bytes: int, frozen: Path, new_top: Path,
                   mark: Callable[[str], None]) -> tuple[mmap.mmap, str]:
    """The copy's buffer and the new disk top, made at once; whichever is ready first is marked first.
    If one fails the other is undone."""
    async def buffer() -> mmap.mmap:
        ready = await asyncio.to_thread(guest_ram.prepare_read, vm.pid, memory, memory_bytes)
        mark("buffer_prepared")
        return ready

    async def overlay() -> str:
        node = await _prepare_overlay(qmp, frozen, new_top)
        mark("overlay_prepared")
        return node

    made = await asyncio.gather(buffer(), overlay(), return_exceptions=True)
    failed = next((r for r in made if isinstance(r, BaseException)), None)
    if failed is None:
        return made[0], made[1]  # type: ignore[return-value]
    if isinstance(made[0], mmap.mmap):
        made[0].close()
    if isinstance(made[1], str):
        with contextlib.suppress(QMPError):
            await qmp.execute("blockdev-del", {"node-name": made[1]})
        new_top.unlink(missing_ok=True)
    raise failed


async def _prepare_overlay(qmp: Monitor, frozen: Path, new_top: Path) -> str:
    """An empty overlay over ``frozen``, opened by QEMU as a node not yet in use: switching to it while
    the guest is stopped is then one QMP command, no file creation."""
    blocks = await qmp.execute("query-block")
    size = next((b["inserted"]["image"]["virtual-size"] for b in blocks
                 if b.get("device") == ROOT_DRIVE and "inserted" in b), None)
    if size is None:
        raise VmmError(f"QEMU of {qmp.vm.name} has no disk {ROOT_DRIVE!r} to branch")
    # -u: the backing file is in use (locked) by this VM; its size is known from QEMU.
    await qemu_img("create", "-q", "-f", "qcow2", "-u", "-b", str(frozen), "-F", "qcow2", str(new_top), str(size))
    node = f"top-{secrets.token_hex(4)}"
    name: str | None = None
    try:
        # A jailed QEMU may not reach the file by its name: it gets descriptors, read-write and read-only
        # (for when the next BRANCH freezes this top), in an fd set that lives as long as the VMM.
        fds = [os.open(new_top, mode | os.O_CLOEXEC) for mode in (os.O_RDWR, os.O_RDONLY)]
        try:
            name = await qmp.add_fds(fds, f"forkd:{new_top.name}")
        finally:
            for fd in fds:
                os.close(fd)
        await qmp.execute("blockdev-add", {"driver": "qcow2", "node-name": node, "discard": "unmap",
                                           "file": {"driver": "file", "filename": name}, "backing": None})
    except BaseException:
        if name is not None:
            await _remove_fdset(qmp, name)
        new_top.unlink(missing_ok=True)
        raise
    return node


@contextlib.asynccontextmanager
async def _passed_file(qmp: Monitor, path: Path) -> AsyncIterator[str]:
    """``path`` created by the daemon and handed to QEMU for one command (a jailed QEMU may not create
    files): the name QEMU opens it by."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        name = await qmp.add_fds([fd], f"forkd:{path.name}")
        try:
            yield name
        finally:
            await _remove_fdset(qmp, name)
    finally:
        os.close(fd)


async def _remove_fdset(qmp: Monitor, name: str) -> None:
    """Closes QEMU's copies of the descriptors passed as ``name`` (``/dev/fdset/N``) once nothing uses them."""
    with contextlib.suppress(QMPError, VmmError):
        await qmp.execute("remove-fd", {"fdset-id": int(name.rsplit("/", 1)[1])})


def _fsync(path: Path) -> None:
    with open(path, "rb+") as written:
        os.fsync(written.fileno())
