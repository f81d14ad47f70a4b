"""The ``-accel`` choice: one TCG thread for a multi-vCPU guest on a QEMU whose multi-threaded TCG races
(before 8.1: a stale ``int3`` oopsed the guest kernel at boot), and nothing else changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.vmm import qemu_machine
from forkd.vmm.accel import accel_option
from forkd.vmm.base import BootSpec


@pytest.mark.parametrize(("accelerator", "vcpus", "version", "expected"), [
    ("tcg", 2, "7.2.22", "tcg,tb-size=32,thread=single"),  # the racy QEMU of Debian 12, multi-vCPU: the fix
    ("tcg", 8, "8.0.4", "tcg,tb-size=32,thread=single"),
    ("tcg", 2, "not a version", "tcg,tb-size=32,thread=single"),  # unreadable: the safe side
    ("tcg", 1, "7.2.22", "tcg,tb-size=32"),  # one vCPU: no other thread to race with, unchanged
    ("tcg", 2, "8.1.0", "tcg,tb-size=32"),  # fixed QEMU: keeps a host thread per vCPU
    ("tcg", 4, "10.0.2", "tcg,tb-size=32"),
    ("kvm", 2, "7.2.22", "kvm"),  # KVM is never touched
    ("kvm", 1, "7.2.22", "kvm"),
])
def test_the_accel_option(accelerator: str, vcpus: int, version: str, expected: str) -> None:
    assert accel_option(accelerator, vcpus, 32, version) == expected


@pytest.mark.parametrize(("accelerator", "vcpus", "expected"), [
    ("tcg", 2, "tcg,tb-size=32,thread=single"), ("tcg", 1, "tcg,tb-size=32"), ("kvm", 2, "kvm")])
def test_the_machine_passes_it_to_qemu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accelerator: str,
                                       vcpus: int, expected: str) -> None:
    monkeypatch.setattr(qemu_machine, "machine_type", lambda _binary: "pc-q35-7.2")
    monkeypatch.setattr(qemu_machine, "qemu_version", lambda _binary: "7.2.22")
    spec = BootSpec(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd.img", cmdline="", memory_mib=256,
                    vcpus=vcpus, kernel_sha256="0" * 64, agent_version="0")
    argv = qemu_machine.QemuMachine("qemu-system-x86_64", accelerator, "qemu64").argv(
        spec, tmp_path, tmp_path / "disk.qcow2", tmp_path / "ram", share=True)
    assert argv[argv.index("-accel") + 1] == expected
    assert argv[argv.index("-smp") + 1] == str(vcpus)  # the guest keeps every vCPU it asked for
