"""Host checks for ``forkd doctor`` and the quickstart preflight: what works, and how to fix what does not."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from forkd.config import Paths
from forkd.host.isolation_checks import isolation_checks
from forkd.vmm.accel import choose_accelerator, probe_kvm
from forkd.vmm.kvm_speed import probe_speed

MIN_FREE_DISK_GIB = 4
# (check name, command, Debian package): failures here are fixed by installing the package
TOOLS = (("qemu", ["qemu-system-x86_64", "--version"], "qemu-system-x86"),
         ("qemu-img", ["qemu-img", "--version"], "qemu-utils"),
         ("debootstrap", ["debootstrap", "--version"], "debootstrap"),
         ("mkfs.ext4", ["mkfs.ext4", "-V"], "e2fsprogs"),
         ("nft", ["nft", "--version"], "nftables"))
PACKAGE_CHECKS = frozenset(name for name, _, _ in TOOLS)


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok", "warn" or "fail"
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _command_version(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    out = done.stdout or done.stderr  # mkfs.ext4 -V answers on stderr
    return out.splitlines()[0].strip() if out else ""


def run_checks(paths: Paths) -> list[Check]:
    supported = platform.system() == "Linux" and platform.machine() == "x86_64"
    checks = [Check("platform", "ok" if supported else "fail",
                    f"{platform.system()} {platform.machine()} {platform.release()}",
                    "" if supported else "forkd needs Linux on x86_64")]
    if os.geteuid() != 0:
        checks.append(Check("root", "warn", "not running as root",
                            "run forkd as root: debootstrap, network namespaces and cgroups need it"))
    kvm = probe_kvm()
    checks.append(Check("kvm", "ok" if kvm.usable else "warn", kvm.detail,
                        "" if kvm.usable else "VMs run under TCG (slower, same behaviour); use a host with VT-x/AMD-V "
                        "for KVM"))
    if kvm.present:
        hardware_speed, speed = probe_speed()
        checks.append(Check("kvm speed", "ok" if hardware_speed else "warn", speed,
                            "" if hardware_speed else "guest kernels cannot run at speed on this KVM; forkd uses TCG"))
    accel, reason = choose_accelerator("auto")
    checks.append(Check("accelerator", "ok", f"{accel}: {reason}"))
    for name, argv, package in TOOLS:
        version = _command_version(argv) if shutil.which(argv[0]) else None
        checks.append(Check(name, "ok" if version is not None else "fail", version or "not installed",
                            "" if version is not None else f"run `bash scripts/setup` (installs {package})"))
    checks += isolation_checks(Check)
    images = [manifest.parent.name for manifest in paths.images.glob("*/manifest.json")]
    checks.append(Check("image cache", "ok" if images else "warn",
                        f"{paths.images}: {', '.join(sorted(images)) or 'no images'}",
                        "" if images else "build one with `forkd image build`"))
    probe_dir = paths.home if paths.home.exists() else Path("/")
    free_gib = shutil.disk_usage(probe_dir).free / 2**30
    checks.append(Check("free disk", "ok" if free_gib >= MIN_FREE_DISK_GIB else "fail",
                        f"{free_gib:.1f} GiB free under {probe_dir}",
                        "" if free_gib >= MIN_FREE_DISK_GIB else
                        f"free at least {MIN_FREE_DISK_GIB} GiB (images and snapshots need it) or set FORKD_HOME"))
    return checks
