"""Choosing the accelerator: KVM only when it is backed by hardware virtualization.

On some hosts /dev/kvm exists but is PVM (``kvm_pvm``): it runs the guest's ring-0 code of a
stock kernel through an instruction emulator at ~1.6 M instr/s and then fails on ``xrstor`` or
``cmpxchg16b``. TCG is far faster there, so a working ``/dev/kvm`` is not enough to pick KVM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

KVM_DEVICE = Path("/dev/kvm")


@dataclass(frozen=True)
class KvmProbe:
    present: bool  # /dev/kvm can be opened read-write
    hardware: bool  # the CPU advertises VT-x (vmx) or AMD-V (svm)
    pvm: bool  # the kvm_pvm module backs /dev/kvm
    detail: str

    @property
    def usable(self) -> bool:
        return self.present and self.hardware and not self.pvm


def _cpu_flags(cpuinfo: Path) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def probe_kvm(dev: Path = KVM_DEVICE, cpuinfo: Path = Path("/proc/cpuinfo"),
              modules: Path = Path("/sys/module")) -> KvmProbe:
    """Tell hardware KVM from PVM or no KVM at all, with a sentence saying why."""
    present = dev.exists() and os.access(dev, os.R_OK | os.W_OK)
    flags = _cpu_flags(cpuinfo)
    hardware = bool(flags & {"vmx", "svm"})
    pvm = (modules / "kvm_pvm").exists()
    if not present:
        detail = f"{dev} is missing or not read-write: using TCG (software emulation)"
    elif pvm:
        detail = "KVM is PVM (kvm_pvm): stock guest kernels run emulated, so TCG is faster"
    elif not hardware:
        detail = "/dev/kvm exists but the CPU shows no vmx/svm flag: using TCG"
    else:
        detail = "hardware-backed KVM"
    return KvmProbe(present=present, hardware=hardware, pvm=pvm, detail=detail)


def choose_accelerator(requested: str = "auto") -> tuple[str, str]:
    """Return ``(accelerator, reason)`` for ``auto``, ``kvm`` or ``tcg``."""
    if requested not in {"auto", "kvm", "tcg"}:
        raise ValueError(f"accelerator must be auto, kvm or tcg, not {requested!r}")
    probe = probe_kvm()
    if requested == "tcg":
        return "tcg", "TCG requested"
    if requested == "kvm":
        if not probe.present:
            raise ValueError(f"KVM requested but {probe.detail}")
        return "kvm", "KVM requested"
    return ("kvm", probe.detail) if probe.usable else ("tcg", probe.detail)
