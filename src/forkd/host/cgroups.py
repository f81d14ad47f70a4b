"""One cgroup per sandbox for its VMM process: memory, CPU (quota and weight) and pids limits.

cgroup v2 is used when its hierarchy has the memory, cpu and pids controllers; otherwise each
controller's v1 hierarchy (these machines: hybrid, v2 holds only hugetlb). Under v1 the sandbox
cgroups nest under the daemon's own cgroup (``<its cgroup>/forkd/<sandbox id>``), so whatever
limits the daemon is under also bound its children; under v2 the no-internal-process rule
forbids that, so they live in ``/forkd/<sandbox id>`` at the root.

The memory limit counts what the kernel charges to the VMM: its private pages (the guest RAM the
child dirtied, QEMU's own heap) and page cache it faulted in first. When it is exceeded the
kernel's OOM killer ends the VMM; :meth:`SandboxCgroup.oom_kills` says so afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from forkd.validation import SANDBOX_ID_PREFIX

CGROUP_FS = Path("/sys/fs/cgroup")
PARENT = "forkd"
CONTROLLERS = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000
RMDIR_TRIES = 50
_MIB = 1024 * 1024


class CgroupError(RuntimeError):
    """A limit could not be applied; the message says which and why."""


@dataclass(frozen=True)
class Limits:
    memory_limit_mib: int | None = None
    cpu_quota: float | None = None  # cores, e.g. 0.5
    cpu_weight: int | None = None  # 1-10000, 100 is the default share
    pids_max: int | None = None

    def to_dict(self) -> dict[str, float | int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _own_cgroup(controller: str, proc_cgroup: Path = Path("/proc/self/cgroup")) -> str:
    """This process's cgroup path in the v1 hierarchy of ``controller`` ("/" if not listed)."""
    for line in proc_cgroup.read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path
    return "/"


def _v1_mounts(mounts: Path = Path("/proc/self/mounts")) -> dict[str, Path]:
    """Controller name → mount point of its v1 hierarchy (``cpu,cpuacct`` mounts serve both)."""
    found = {}
    for line in mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup":
            for option in fields[3].split(","):
                found.setdefault(option, Path(fields[1]))
    return found


@dataclass(frozen=True)
class CgroupLayout:
    """Where sandbox cgroups go: one parent directory per controller (all the same under v2)."""

    version: int
    parents: dict[str, Path]

    @classmethod
    def detect(cls, root: Path = CGROUP_FS) -> CgroupLayout | None:
        for unified in (root, root / "unified"):
            controllers = unified / "cgroup.controllers"
            if controllers.exists() and set(CONTROLLERS) <= set(controllers.read_text().split()):
                return cls(2, {c: unified / PARENT for c in CONTROLLERS})
        mounts = _v1_mounts()
        parents = {c: mounts[c] / _own_cgroup(c).lstrip("/") / PARENT for c in CONTROLLERS if c in mounts}
        return cls(1, parents) if parents else None

    def describe(self) -> str:
        if self.version == 2:
            return f"cgroup v2 at {self.parents['memory'].parent} ({', '.join(CONTROLLERS)})"
        return "cgroup v1: " + ", ".join(f"{c} at {p.parent}" for c, p in self.parents.items())

    def missing(self) -> list[str]:
        return [c for c in CONTROLLERS if c not in self.parents]

    def sandbox(self, sandbox_id: str) -> SandboxCgroup:
        return SandboxCgroup(self, sandbox_id)

    def leftovers(self) -> list[str]:
        """Sandbox ids that have a cgroup under a forkd parent, live or not."""
        found: set[str] = set()
        for parent in self.parents.values():
            if parent.is_dir():
                found.update(d.name for d in parent.iterdir() if d.is_dir() and d.name.startswith(SANDBOX_ID_PREFIX))
        return sorted(found)


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value.strip()!r} to {path}: {exc.strerror}") from None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().split()[0]
    except (OSError, IndexError):
        return None
    return None if text == "max" else int(text)


def _keyed(path: Path, key: str) -> int:
    """The value of ``key N`` in a flat keyed file such as memory.events."""
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


@dataclass(frozen=True)
class SandboxCgroup:
    layout: CgroupLayout
    sandbox_id: str

    def dir(self, controller: str) -> Path:
        return self.layout.parents[controller] / self.sandbox_id

    def _dirs(self) -> list[Path]:
        return list(dict.fromkeys(self.dir(c) for c in self.layout.parents))

    def create(self, limits: Limits) -> None:
        """Make the cgroup and apply ``limits``; on any failure nothing is left behind."""
        needed = {"memory": limits.memory_limit_mib, "cpu": limits.cpu_quota or limits.cpu_weight,
                  "pids": limits.pids_max}
        absent = [c for c, wanted in needed.items() if wanted and c not in self.layout.parents]
        if absent:
            raise CgroupError(f"this host has no {' or '.join(absent)} cgroup controller; "
                              f"run `forkd doctor` or fork without that limit")
        try:
            for parent in dict.fromkeys(self.layout.parents.values()):
                parent.mkdir(parents=True, exist_ok=True)
                if self.layout.version == 2:
                    _write(parent.parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
                    _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
            for directory in self._dirs():
                directory.mkdir()
            self._apply(limits)
        except (OSError, CgroupError) as exc:
            self.remove()
            if isinstance(exc, CgroupError):
                raise
            raise CgroupError(f"cannot create the cgroup of {self.sandbox_id}: {exc}") from None

    def _apply(self, limits: Limits) -> None:
        v2 = self.layout.version == 2
        if limits.memory_limit_mib is not None:
            memory, limit = self.dir("memory"), str(limits.memory_limit_mib * _MIB)
            if v2:
                _write(memory / "memory.max", limit)
                if (memory / "memory.swap.max").exists():
                    _write(memory / "memory.swap.max", "0")
            else:
                _write(memory / "memory.limit_in_bytes", limit)
                if (memory / "memory.memsw.limit_in_bytes").exists():  # swap counts too: no escape to swap
                    _write(memory / "memory.memsw.limit_in_bytes", limit)
        if "memory" in self.layout.parents and not v2:
            # Charges made between spawn and attach move in with the process (v1 only).
            with contextlib.suppress(CgroupError):
                _write(self.dir("memory") / "memory.move_charge_at_immigrate", "3")
        cpu = self.dir("cpu") if "cpu" in self.layout.parents else None
        if limits.cpu_quota is not None and cpu is not None:
            quota = max(1000, round(limits.cpu_quota * CPU_PERIOD_US))
            if v2:
                _write(cpu / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(cpu / "cpu.cfs_quota_us", str(quota))
        if limits.cpu_weight is not None and cpu is not None:
            if v2:
                _write(cpu / "cpu.weight", str(limits.cpu_weight))
            else:  # the mapping systemd uses: weight 100 = 1024 shares
                _write(cpu / "cpu.shares", str(max(2, limits.cpu_weight * 1024 // 100)))
        if limits.pids_max is not None:
            _write(self.dir("pids") / "pids.max", str(limits.pids_max))

    def attach(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into this sandbox's cgroups."""
        for directory in self._dirs():
            _write(directory / "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended in this cgroup."""
        if "memory" not in self.layout.parents:
            return 0
        memory = self.dir("memory")
        if self.layout.version == 2:
            return _keyed(memory / "memory.events", "oom_kill")
        return _keyed(memory / "memory.oom_control", "oom_kill")

    def applied(self) -> dict[str, int | float | None]:
        """The limits as the kernel has them and what is used now, read back from the cgroup files."""
        info: dict[str, int | float | None] = {}
        v2 = self.layout.version == 2
        if "memory" in self.layout.parents:
            memory = self.dir("memory")
            limit = _read_int(memory / ("memory.max" if v2 else "memory.limit_in_bytes"))
            info["memory_limit_mib"] = None if limit is None or limit >= 1 << 62 else limit // _MIB
            current = _read_int(memory / ("memory.current" if v2 else "memory.usage_in_bytes"))
            peak = _read_int(memory / ("memory.peak" if v2 else "memory.max_usage_in_bytes"))
            info["memory_current_kib"] = None if current is None else current // 1024
            info["memory_peak_kib"] = None if peak is None else peak // 1024
        if "cpu" in self.layout.parents:
            cpu = self.dir("cpu")
            if v2:
                quota_text = (cpu / "cpu.max").read_text().split() if (cpu / "cpu.max").exists() else ["max"]
                quota = None if quota_text[0] == "max" else int(quota_text[0]) / int(quota_text[1])
                info["cpu_weight"] = _read_int(cpu / "cpu.weight")
            else:
                quota_us, period_us = _read_int(cpu / "cpu.cfs_quota_us"), _read_int(cpu / "cpu.cfs_period_us")
                quota = None if quota_us is None or quota_us < 0 or not period_us else quota_us / period_us
                shares = _read_int(cpu / "cpu.shares")
                info["cpu_weight"] = None if shares is None else shares * 100 // 1024
            info["cpu_quota"] = quota
        if "pids" in self.layout.parents:
            info["pids_max"] = _read_int(self.dir("pids") / "pids.max")
            info["pids_current"] = _read_int(self.dir("pids") / "pids.current")
        return info

    def remove(self) -> bool:
        """Kill anything still inside (only this sandbox's VMM ever is) and remove the cgroup; idempotent."""
        removed = False
        for directory in self._dirs():
            if not directory.exists():
                continue
            for _ in range(RMDIR_TRIES):
                with contextlib.suppress(OSError):
                    for pid in (directory / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                try:
                    directory.rmdir()
                    removed = True
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    time.sleep(0.02)  # a killed process leaves its cgroup once it has fully exited
            else:
                raise CgroupError(f"cgroup {directory} is still busy; its processes did not exit")
        return removed


def release_cgroup(sandbox_id: str, layout: CgroupLayout | None = None) -> bool:
    """Remove ``sandbox_id``'s cgroups if they exist; idempotent. True if something was removed."""
    layout = layout or CgroupLayout.detect()
    return layout.sandbox(sandbox_id).remove() if layout is not None else False


def leftover_cgroups(layout: CgroupLayout | None = None) -> list[str]:
    layout = layout or CgroupLayout.detect()
    return layout.leftovers() if layout is not None else []
