"""A guest's serial console cannot fill the host's disk: the VMM appends to it, and the runtime cuts
a live sandbox's console (or a baking parent's) to its end once it passes a bound, while the VMM
goes on writing.

The writer is a real file descriptor opened as QEMU's ``append=on`` file chardev opens it; the
runtime test forks a real (fake-VMM) sandbox and runs the daemon's console keeper on it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from test_runtime_fake_vmm import _image, _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.runtime.keepers import console_keeper
from forkd.runtime.snapshots import SnapshotRequest
from forkd.vmm import qemu_machine
from forkd.vmm.base import CONSOLE_KEEP_BYTES, CONSOLE_LOG, BootSpec, VmHandle
from forkd.vmm.fake import FakeVmm

MIB = 1 << 20


def _appender(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def test_a_console_past_its_bound_is_cut_to_its_end_and_the_vmm_appends_after_it(tmp_path: Path) -> None:
    vm = VmHandle(name="sb-console00000", run_dir=tmp_path, process=None, agent_socket=tmp_path / "agent.sock")  # type: ignore[arg-type]
    qemu = _appender(tmp_path / CONSOLE_LOG)
    try:
        os.write(qemu, b"x" * MIB)
        assert vm.bound_logs(2 * MIB) is False and (tmp_path / CONSOLE_LOG).stat().st_size == MIB
        os.write(qemu, b"y" * (2 * MIB) + b"last words\n")
        assert vm.bound_logs(2 * MIB) is True
        os.write(qemu, b"after the cut\n")
    finally:
        os.close(qemu)
    console = (tmp_path / CONSOLE_LOG).read_bytes()
    assert len(console) < CONSOLE_KEEP_BYTES + 200
    assert console.startswith(b"[forkd: the console passed 2097152 bytes; its first ")
    assert console.endswith(b"y" * 100 + b"last words\nafter the cut\n")


def test_the_vmm_opens_the_console_for_appending(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without append, QEMU would go on writing at its old offset after a cut: the file stays as large."""
    monkeypatch.setattr(qemu_machine, "machine_type", lambda _binary: "pc-q35-7.2")
    monkeypatch.setattr(qemu_machine, "qemu_version", lambda _binary: "7.2.22")
    spec = BootSpec(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd.img", cmdline="", memory_mib=256, vcpus=1,
                    kernel_sha256="0" * 64, agent_version="0")
    argv = qemu_machine.QemuMachine("qemu-system-x86_64", "tcg", "qemu64").argv(
        spec, tmp_path, tmp_path / "disk.qcow2", tmp_path / "ram", share=False)
    assert f"file,id=console,path={tmp_path / CONSOLE_LOG},append=on" in argv


def test_the_daemon_keeps_a_flooding_sandboxs_console_bounded(tmp_path: Path) -> None:
    async def scenario() -> tuple[int, int]:
        runtime = await _runtime(tmp_path, FakeVmm())
        keeper: asyncio.Task[None] | None = None
        try:
            [outcome] = await runtime.spawner.fork("base", 1)
            console = runtime.sandboxes.get(outcome.sandbox["id"]).vm.run_dir / CONSOLE_LOG
            guest = _appender(console)
            try:
                os.write(guest, b"z" * (3 * MIB))
                keeper = asyncio.create_task(console_keeper(runtime.consoles, interval_s=0.01, max_bytes=MIB))
                for _ in range(1000):  # bounded: at most ~10 s
                    if console.stat().st_size < MIB:
                        break
                    await asyncio.sleep(0.01)
                os.write(guest, b"still writing\n")
            finally:
                os.close(guest)
            return console.stat().st_size, len(console.read_bytes().splitlines())
        finally:
            if keeper is not None:
                keeper.cancel()
            await runtime.stop()

    size, lines = run(scenario)
    assert size < CONSOLE_KEEP_BYTES + 200 and lines == 2  # the note, then the kept end and what followed


class SlowSave(FakeVmm):
    """A FakeVmm whose parents wait to be saved until told: a bake that takes its time."""

    def __init__(self) -> None:
        super().__init__()
        self.saving = asyncio.Event()
        self.go_on = asyncio.Event()

    async def save(self, vm: VmHandle, state: Path) -> None:
        self.saving.set()
        await self.go_on.wait()
        await super().save(vm, state)


def test_the_daemon_keeps_a_baking_parents_console_bounded(tmp_path: Path) -> None:
    """`snapshot create` runs its parent for up to 15 minutes: its console is cut like a sandbox's."""
    async def scenario() -> tuple[int, int, str]:
        vmm = SlowSave()
        runtime = await _runtime(tmp_path, vmm, tag=None)
        keeper = asyncio.create_task(console_keeper(runtime.consoles, interval_s=0.01, max_bytes=MIB))
        baking = asyncio.create_task(runtime.snapshots.create(
            SnapshotRequest(tag="base", memory_mib=1, warm_modules=()), _image(tmp_path), lambda _line: None))
        try:
            await vmm.saving.wait()  # the parent is up, being baked
            [build_dir] = runtime.paths.snapshots.glob(".build-base-*")
            console = build_dir / CONSOLE_LOG
            guest = _appender(console)
            try:
                os.write(guest, b"p" * (3 * MIB))
                for _ in range(1000):  # bounded: at most ~10 s
                    if console.stat().st_size < MIB:
                        break
                    await asyncio.sleep(0.01)
                os.write(guest, b"still booting\n")
            finally:
                os.close(guest)
            size, lines = console.stat().st_size, len(console.read_bytes().splitlines())
            vmm.go_on.set()
            return size, lines, (await baking).status
        finally:
            vmm.go_on.set()
            keeper.cancel()
            await asyncio.gather(baking, return_exceptions=True)
            await runtime.stop()

    size, lines, status = run(scenario)
    assert size < CONSOLE_KEEP_BYTES + 200 and lines == 2 and status == "ready"
