"""Host checks for ``forkd doctor`` and the quickstart preflight: what works, and how to fix what does not."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from forkd.config import Paths
from forkd.host import probes
from forkd.vmm.accel import choose_accelerator, probe_kvm
from forkd.vmm.base import VmmError
from forkd.vmm.jail import Jail, JailSettings
from forkd.vmm.qemu_machine import QEMU_BINARY, cpu_model, machine_type
from forkd.vmm.kvm_speed import probe_speed
from forkd.vmm.procmem import soft_dirty_supported

MIN_FREE_DISK_GIB = 4
MIN_FREE_MEMORY_GIB = 2
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
IP_FORWARD_CHECK = "ip_forward"
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
    """Every check, in the order a user fixes them: platform, virtualization, tools, kernel, resources.

    Needs the server side (``forkd[daemon]``: the network checks use pyroute2); ``Check`` alone does not, so a
    light client still reads a remote daemon's checks."""
    from forkd.host.isolation_checks import isolation_checks
    return [*_platform(), *_virtualization(), *_tools(), *_images(paths), *_cgroups(), *_network(),
            *isolation_checks(Check),
            *_memory_features(), *_resources(paths)]


def _platform() -> list[Check]:
    supported = platform.system() == "Linux" and platform.machine() == "x86_64"
    checks = [Check("platform", "ok" if supported else "fail",
                    f"{platform.system()} {platform.machine()} {platform.release()}",
                    "" if supported else "forkd needs Linux on x86_64")]
    if os.geteuid() != 0:
        checks.append(Check("root", "warn", "not running as root",
                            "run forkd as root: debootstrap, network namespaces and cgroups need it"))
    return checks


def _virtualization() -> list[Check]:
    kvm = probe_kvm()
    checks = [Check("kvm", "ok" if kvm.usable else "warn", kvm.detail,
                    "" if kvm.usable else "VMs run under TCG (slower, same behaviour); use a host with VT-x/AMD-V "
                    "for KVM")]
    if kvm.present:
        hardware_speed, speed = probe_speed()
        checks.append(Check("kvm speed", "ok" if hardware_speed else "warn", speed,
                            "" if hardware_speed else "guest kernels cannot run at speed on this KVM; forkd uses TCG"))
    accel, reason = choose_accelerator("auto")
    checks.append(Check("accelerator", "ok", f"{accel}: {reason}"))
    checks.append(Check("guest cpu", "ok", f"{cpu_model(accel)} (recorded in every snapshot's identity)"))
    return checks


def _tools() -> list[Check]:
    checks = []
    for name, argv, package in TOOLS:
        version = _command_version(argv) if shutil.which(argv[0]) else None
        checks.append(Check(name, "ok" if version is not None else "fail", version or "not installed",
                            "" if version is not None else f"run `bash scripts/setup` (installs {package})"))
    if shutil.which(QEMU_BINARY):
        try:
            checks.append(Check("machine", "ok", f"{machine_type(QEMU_BINARY)} (the q35 alias, pinned to this "
                                                 "QEMU's versioned machine in every snapshot's identity)"))
        except VmmError as exc:
            checks.append(Check("machine", "fail", str(exc), "run `bash scripts/setup` (installs qemu-system-x86)"))
    checks.append(_jail())
    firecracker = _command_version(["firecracker", "--version"]) if shutil.which("firecracker") else None
    checks.append(Check("firecracker", "ok", firecracker or "not installed (optional: forkd runs on QEMU)"))
    return checks


def _jail() -> Check:
    """What the daemon refuses to start without (unless `[confinement] enabled = false`), with the default range."""
    jail = Jail(JailSettings())
    try:
        jail.check()
    except VmmError as exc:
        return Check("vmm jail", "fail", str(exc), "see docs/security.md, \"The VMM process\"")
    return Check("vmm jail", "ok", f"each VMM: its own uid from {jail.ids}, pid and mount namespaces, rlimits")


def _images(paths: Paths) -> list[Check]:
    manifests = {m.parent.name: m for m in paths.images.glob("*/manifest.json")}
    checks = [Check("image cache", "ok" if manifests else "warn",
                    f"{paths.images}: {', '.join(sorted(manifests)) or 'no images'}",
                    "" if manifests else "build one with `forkd image build`")]
    if "default" in manifests:
        try:
            kernel = json.loads(manifests["default"].read_text()).get("kernel_version", "?")
            checks.append(Check("guest kernel", "ok", f"default image: Linux {kernel}"))
        except (OSError, ValueError) as exc:
            checks.append(Check("guest kernel", "fail", f"unreadable manifest ({exc})",
                                "rebuild it with `forkd image build --force`"))
    return checks


def _cgroups() -> list[Check]:
    cgroups = probes.probe_cgroups()
    detail = (f"{cgroups.version}: v2 [{' '.join(cgroups.v2_controllers) or '-'}], "
              f"v1 [{' '.join(cgroups.v1_controllers) or '-'}]")
    missing = cgroups.missing
    return [Check("cgroups", "warn" if missing else "ok", detail,
                  f"no {', '.join(missing)} controller: per-sandbox limits cannot be enforced; enable them in the "
                  "kernel command line (e.g. cgroup_enable=memory)" if missing else "")]


def _network() -> list[Check]:
    netns, tun = probes.probe_netns(), probes.probe_tun()
    nft = _command_version(["nft", "--version"]) if shutil.which("nft") else None
    forward = probes.read_flag(IP_FORWARD)
    return [
        Check("netns", "ok" if netns is None else "warn", "network namespaces can be created" if netns is None
              else f"cannot create a network namespace: {netns}", "" if netns is None else
              "run as root on a kernel with CONFIG_NET_NS; sandboxes need it for their own network"),
        Check("tun", "ok" if tun is None else "warn", "/dev/net/tun opens" if tun is None
              else f"/dev/net/tun: {tun}", "" if tun is None else "load the tun module or create /dev/net/tun"),
        Check("nft", "ok" if nft else "warn", nft or "nft is not installed",
              "" if nft else "install the nftables package (quickstart offers to)"),
        Check(IP_FORWARD_CHECK, "ok" if forward == "1" else "warn", f"net.ipv4.ip_forward = {forward}",
              "" if forward == "1" else "sandboxes with outbound network need it: `sysctl -w net.ipv4.ip_forward=1` "
              "(quickstart offers to)"),
    ]


def _memory_features() -> list[Check]:
    soft_dirty = soft_dirty_supported()
    memfd = probes.probe_memfd()
    ksm = probes.read_flag(Path("/sys/kernel/mm/ksm/run"))
    thp = probes.read_flag(Path("/sys/kernel/mm/transparent_hugepage/enabled"))
    huge = probes.meminfo().get("HugePages_Total", 0)
    return [
        Check("soft_dirty", "ok" if soft_dirty else "warn",
              "the kernel tracks soft-dirty pages" if soft_dirty else "the kernel has no soft-dirty tracking",
              "" if soft_dirty else "live BRANCH copies memory while the guest runs only with a kernel built "
              "with CONFIG_MEM_SOFT_DIRTY; without it, live pauses like diff and full (it still works)"),
        Check("memfd", "ok" if memfd is None else "warn", "memfd_create works" if memfd is None
              else f"memfd_create: {memfd}"),
        Check("ksm", "ok", "not in this kernel" if ksm is None else f"/sys/kernel/mm/ksm/run = {ksm} "
              f"({'merging' if ksm == '1' else 'off'}); children already share pages copy-on-write"),
        Check("hugepages", "ok", f"transparent: {thp or 'unavailable'}; reserved: {huge}"),
    ]


def _resources(paths: Paths) -> list[Check]:
    checks = []
    for label, directory in (("free disk (home)", paths.home), ("free disk (cache)", paths.cache)):
        probe_dir = next((d for d in (directory, *directory.parents) if d.exists()), Path("/"))
        free_gib = shutil.disk_usage(probe_dir).free / 2**30
        checks.append(Check(label, "ok" if free_gib >= MIN_FREE_DISK_GIB else "fail",
                            f"{free_gib:.1f} GiB free under {probe_dir}",
                            "" if free_gib >= MIN_FREE_DISK_GIB else
                            f"free at least {MIN_FREE_DISK_GIB} GiB (images and snapshots need it) or point "
                            "FORKD_HOME / FORKD_CACHE at a larger filesystem"))
    available_gib = probes.meminfo().get("MemAvailable", 0) / 2**20
    checks.append(Check("free memory", "ok" if available_gib >= MIN_FREE_MEMORY_GIB else "warn",
                        f"{available_gib:.1f} GiB available",
                        "" if available_gib >= MIN_FREE_MEMORY_GIB else
                        "a parent needs its RAM (default 1 GiB) and each child ~40 MiB; free memory or bake "
                        "smaller snapshots (--memory-mib)"))
    return checks


def enable_ip_forward() -> None:
    """The one host setting quickstart changes (with consent): not persistent across reboots."""
    IP_FORWARD.write_text("1\n")
