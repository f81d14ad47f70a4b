"""A branch layer exported without a parent (its sandbox's last branch was removed) takes in the VM's own
earlier layers, with real qemu-img: the run directory's layers stay locked for writing by the process that
opened them (QEMU keeps its earlier disk tops so; qemu-io stands in here), and the exported layer then
lies over the snapshot's disk and reads exactly as the VM's disk does."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from forkd.vmm.qemu_disk import QemuDisk, backing_reference

pytestmark = pytest.mark.skipif(not (shutil.which("qemu-img") and shutil.which("qemu-io")),
                                reason="needs qemu-img and qemu-io (scripts/setup installs them)")

MIB = 1 << 20


def _img(*args: str) -> None:
    subprocess.run(["qemu-img", *args], check=True, capture_output=True, timeout=60)


def _write(disk: Path, offset_mib: int, pattern: int) -> None:
    subprocess.run(["qemu-io", "-c", f"write -P {pattern} {offset_mib}M 1M", str(disk)], check=True,
                   capture_output=True, timeout=60)


def _holder(disk: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["qemu-io", "-c", "sleep 600000", str(disk)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextmanager
def _held_for_writing(*disks: Path) -> Iterator[None]:
    """Each disk open read-write by a process of its own, as QEMU holds the tops it wrote before.

    Held once qemu-img can no longer open it beside its holder. That probe can itself make the holder's
    open fail (the two lock each other out), so a holder that exited is started again."""
    holders = {disk: _holder(disk) for disk in disks}
    try:
        for disk in disks:
            deadline = time.monotonic() + 60
            while True:
                if holders[disk].poll() is not None:  # its open lost to the probe: open it again
                    holders[disk] = _holder(disk)
                elif subprocess.run(["qemu-img", "info", str(disk)], capture_output=True, timeout=60).returncode:
                    break  # refused beside its live holder: held
                assert time.monotonic() < deadline, f"qemu-io did not lock {disk}"
                time.sleep(0.05)
        yield
    finally:
        for holder in holders.values():
            holder.kill()
            holder.wait()


def test_a_layer_without_a_parent_takes_in_the_vms_own_layers_while_they_are_locked(tmp_path: Path) -> None:
    snapshot, run_dir, build = tmp_path / "snapshots" / "base", tmp_path / "run", tmp_path / "snapshots" / ".build"
    for directory in (snapshot, run_dir, build):
        directory.mkdir(parents=True)
    base = snapshot / "base.raw"
    _img("create", "-q", "-f", "raw", str(base), "16M")
    _write(base, 0, 0x11)
    layer = snapshot / "disk.qcow2"  # the snapshot's layer, by relative name as snapshots record it
    _img("create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", str(layer))
    _write(layer, 1, 0x22)
    first = run_dir / "disk.qcow2"  # the VM's first disk, then the top of its first BRANCH
    _img("create", "-q", "-f", "qcow2", "-b", str(layer), "-F", "qcow2", str(first))
    _write(first, 2, 0x33)
    _write(first, 1, 0x44)  # over the snapshot's own write
    frozen = run_dir / "top-1.qcow2"  # the top the next BRANCH froze
    _img("create", "-q", "-f", "qcow2", "-b", str(first), "-F", "qcow2", str(frozen))
    _write(frozen, 3, 0x55)
    exported = build / "disk.qcow2"
    with _held_for_writing(first):
        asyncio.run(QemuDisk().export_layer(frozen, exported, None))
    assert backing_reference(exported) == (str(layer), "qcow2")
    compared = subprocess.run(["qemu-img", "compare", "-U", str(frozen), str(exported)], capture_output=True,
                              text=True, timeout=60)
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert sorted(p.name for p in build.iterdir()) == ["disk.qcow2"]  # the copies it read are gone
