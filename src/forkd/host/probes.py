"""Kernel facilities forkd relies on, each probed by using it (not by reading a version number).

Every probe is side-effect free: a namespace is created in a throwaway child process, a memfd is
created and closed, nothing on the host is changed.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000
NEEDED_CONTROLLERS = ("cpu", "memory", "pids")


def probe_memfd() -> str | None:
    """``None`` when ``memfd_create`` works, else why not."""
    try:
        os.close(os.memfd_create("forkd-probe", os.MFD_CLOEXEC))
    except OSError as exc:
        return exc.strerror
    return None


def probe_netns() -> str | None:
    """Create a network namespace in a throwaway child; ``None`` when that works, else the error."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child takes no loader locks
    unshare = libc.unshare
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only reports through its exit status
        code = 0
        try:
            if unshare(CLONE_NEWNET) != 0:
                code = ctypes.get_errno() or 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return None if code == 0 else os.strerror(code) if code > 0 else f"probe killed by signal {-code}"


def probe_tun() -> str | None:
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        return exc.strerror
    return None


@dataclass(frozen=True)
class Cgroups:
    version: str  # "v2", "v1", "hybrid" or "none"
    v2_controllers: tuple[str, ...]
    v1_controllers: tuple[str, ...]

    @property
    def missing(self) -> list[str]:
        have = set(self.v2_controllers) | set(self.v1_controllers)
        return [c for c in NEEDED_CONTROLLERS if c not in have]


def probe_cgroups(mounts: Path = Path("/proc/self/mounts")) -> Cgroups:
    """cgroup v2 (unified), v1, or both (hybrid), and the controllers each hierarchy has."""
    v2_dirs, v1 = [], set()
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        if parts[2] == "cgroup2":
            v2_dirs.append(Path(parts[1]))
        elif parts[2] == "cgroup":
            v1.update(o for o in parts[3].split(",") if o in {"cpu", "cpuacct", "memory", "pids", "cpuset", "io",
                                                              "blkio", "devices", "freezer", "hugetlb"})
    v2: set[str] = set()
    for directory in v2_dirs:
        try:
            v2.update((directory / "cgroup.controllers").read_text().split())
        except OSError:
            continue
    version = "hybrid" if v2_dirs and v1 else "v2" if v2_dirs else "v1" if v1 else "none"
    return Cgroups(version, tuple(sorted(v2)), tuple(sorted(v1)))


def read_flag(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in KiB (counts such as HugePages_Total as they are)."""
    result = {}
    for line in (read_flag(Path("/proc/meminfo")) or "").splitlines():
        key, _, rest = line.partition(":")
        with_unit = rest.split()
        if with_unit and with_unit[0].isdigit():
            result[key] = int(with_unit[0])
    return result

