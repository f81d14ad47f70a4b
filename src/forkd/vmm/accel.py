"""Choosing the accelerator: KVM only when it is backed by hardware virtualization.

On some hosts /dev/kvm exists but is PVM (``kvm_pvm``): it runs the guest's ring-0 code of a
stock kernel through an instruction emulator at ~1.6 M instr/s and then fails on ``xrstor`` or
``cmpxchg16b``. TCG is far faster there, so a working ``/dev/kvm`` is not enough to pick KVM.
"""

from __future__ import annotations

import os
import re
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


#: The first QEMU whose multi-threaded TCG does not race a translation against an invalidation of
#: the same code (upstream commit deba78709a, "accel/tcg: Always lock pages before translation").
MTTCG_FIXED_IN = (8, 1)


def accel_option(accelerator: str, vcpus: int, tb_size_mib: int, qemu_version: str) -> str:
    """The ``-accel`` value of a VMM: ``kvm``, or TCG with its translation buffer and, on a QEMU before
    8.1 with more than one vCPU, ``thread=single`` (every vCPU on one host thread, in turn).

    Why: QEMU before 8.1 translates guest code without holding the page lock, so under multi-threaded
    TCG one vCPU can translate a block from code another vCPU is rewriting and keep it after the
    rewrite invalidated the page. The guest kernel rewrites its own code live (static keys via
    ``text_poke_bp``: an ``int3`` first, then the rest, then the first byte), so a vCPU could run a
    stale ``int3`` after the patch finished and the kernel oopses (``Oops: int3`` in
    ``hrtimer_start_range_ns``, 4 errors of one CI run; the same oops on jump labels in other projects'
    CI, gone with QEMU 8.1). With one TCG thread no translation runs while another vCPU writes.
    Measured with bench/mttcg_boot.py (docs/benchmarks.md). A 1-vCPU guest, KVM and a fixed QEMU are
    left as they were.
    """
    if accelerator == "kvm":
        return "kvm"
    option = f"tcg,tb-size={tb_size_mib}"
    if vcpus > 1 and _release(qemu_version) < MTTCG_FIXED_IN:
        option += ",thread=single"
    return option


def _release(version: str) -> tuple[int, int]:
    """``(7, 2)`` from ``7.2.22``; an unreadable version counts as old (the safe side)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)
