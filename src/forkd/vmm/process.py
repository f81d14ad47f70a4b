"""VMM processes a daemon did not start itself: found by command line, told apart by start time, held by pidfd.

After a daemon restart its VMMs are no longer its children, so it cannot ``waitpid`` them. A pidfd
(Linux ≥ 5.3) names exactly one process for as long as the fd is open — a reused pid never
matches it — becomes readable when that process exits, and can be signalled without racing a
reuse. A pid is only trusted together with its start time (``/proc/PID/stat`` field 22).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
from dataclasses import dataclass
from pathlib import Path

from forkd.vmm.base import MemoryStats, VmmError

# An adopted VMM is not our child: its exit status cannot be collected, only the fact that it exited.
EXIT_STATUS_UNKNOWN = 255
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started; ``None`` when it no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; the fields after it may not.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19]) if fields[0] != "Z" else None


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time ``pid`` has used (all its threads); ``None`` when it no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@dataclass(frozen=True)
class ProcessRef:
    """A process seen on the host: its pid, start time and the directory its command line names."""

    pid: int
    started: int
    directory: str


def processes_under(root: Path, program: str) -> list[ProcessRef]:
    """Live ``program`` processes whose command line names a directory directly under ``root``.

    ``directory`` is that directory's name, so a VMM of ``sandboxes/sb-x`` is found as ``sb-x``; a
    process naming several directories is listed once for each. Only ``program`` (the VMM binary)
    is matched, so a shell or ``tail`` that happens to name the directory is never touched.
    """
    prefix = str(root).rstrip("/").encode() + b"/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        argv = cmdline(pid)
        if prefix not in argv or Path(argv.split(b"\0", 1)[0].decode(errors="replace")).name != program:
            continue
        started = start_time(pid)
        if started is None:
            continue
        names = {re.split(rb"[/\0,]", tail, maxsplit=1)[0] for tail in argv.split(prefix)[1:]}
        found.extend(ProcessRef(pid=pid, started=started, directory=n.decode(errors="replace")) for n in names)
    return found


def open_verified(pid: int, started: int | None, must_mention: str) -> int | None:
    """A pidfd for ``pid`` if it is still the process that started at ``started`` and names ``must_mention``.

    The identity is checked *after* the pidfd is open: from then on the fd cannot refer to a
    different process, so nothing reused the pid between the check and any later signal.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    if (started is not None and start_time(pid) != started) or must_mention.encode() not in cmdline(pid):
        os.close(pidfd)
        return None
    return pidfd


def kill_pidfd(pidfd: int, timeout_s: float = 10.0) -> bool:
    """SIGKILL the process behind ``pidfd`` and wait (bounded) until it is gone; closes the fd."""
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return bool(select.select([pidfd], [], [], timeout_s)[0])
    finally:
        os.close(pidfd)


class AdoptedProcess:
    """The asyncio-subprocess surface the runtime uses (``pid``, ``returncode``, ``wait``, ``kill``) over a pidfd."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._exited: asyncio.Future[int] | None = None
        self._killed = False

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self.returncode = -signal.SIGKILL if self._killed else EXIT_STATUS_UNKNOWN
        assert self._exited is not None
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        if self._exited is None:
            self._exited = asyncio.get_running_loop().create_future()
            if self._pidfd < 0:
                self._exited.set_result(self.returncode if self.returncode is not None else EXIT_STATUS_UNKNOWN)
            else:
                asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if self._pidfd < 0:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self._killed = True

    def close(self) -> None:
        """Stop watching without killing (the daemon is detaching and leaves the VMM running)."""
        if self._pidfd >= 0:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1


def read_memory_stats(pid: int) -> MemoryStats:
    """Sum of the process's mappings from ``smaps_rollup`` (PSS counts shared pages fractionally)."""
    fields: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError as exc:
        raise VmmError(f"cannot read memory of process {pid}: {exc}") from None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            fields[parts[0][:-1]] = int(parts[1])
    return MemoryStats(
        rss_kib=fields.get("Rss", 0),
        pss_kib=fields.get("Pss", 0),
        private_dirty_kib=fields.get("Private_Dirty", 0),
    )
