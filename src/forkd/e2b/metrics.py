"""E2B's per-sandbox metrics (``Sandbox.get_metrics``), measured inside the guest, as E2B's envd does.

Every ``METRICS_S`` the keeper samples each running sandbox whose metrics a client asked for in the
last ``WATCH_S`` (sampling is a request to the guest, which would keep an idle child from being
stopped, runtime/idle.py; a call finding no fresh sample takes one): CPU from two readings
of the guest's ``/proc/stat`` (the share of the guest's CPU time not idle between them, all vCPUs
together), memory from ``/proc/meminfo`` (used = total - available; cache = page cache and
buffers), both read as files (no process starts in the guest for them). Disk is the root file
system's ``df``, a command, so it is run at most every ``DISK_S`` per sandbox and a sample carries
the latest reading. Each sandbox keeps the last ``HISTORY`` samples (an hour); a paused sandbox keeps
its history and adds none; a killed one's is dropped. A call finding no sample younger than
``METRICS_S`` takes one first.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

from forkd.e2b.errors import E2BError
from forkd.e2b.keys import Principal
from forkd.e2b.sandboxes import E2BSandboxes, rfc3339
from forkd.e2b.storage import OWNER_LABEL
from forkd.runtime.results import CommandSpec
from forkd.runtime.sandboxes import LiveSandbox
from forkd.runtime.sessions import Sessions

METRICS_S = 10.0
DISK_S = 60.0
HISTORY = 360
WATCH_S = 3600.0  # a sandbox is sampled this long after its metrics were last asked for
FIRST_GAP_S = 0.5  # a sandbox's first CPU figure: two readings this far apart
MAX_READ = 1 << 20  # a /proc file larger than this is not what it should be (the guest is hostile)
log = logging.getLogger("forkd.e2b.metrics")


@dataclass(frozen=True)
class Sample:
    at: float
    cpu_count: int
    cpu_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int

    def to_e2b(self) -> dict[str, Any]:
        """E2B's ``SandboxMetric``."""
        return {"timestamp": rfc3339(self.at), "timestampUnix": int(self.at), "cpuCount": self.cpu_count,
                "cpuUsedPct": round(self.cpu_pct, 2), "memUsed": self.mem_used, "memTotal": self.mem_total,
                "memCache": self.mem_cache, "diskUsed": self.disk_used, "diskTotal": self.disk_total}


def cpu_times(stat: str) -> tuple[int, int, int]:
    """(busy, total, cpu count) from /proc/stat: its ``cpu`` line, and one ``cpuN`` line per vCPU."""
    lines = stat.splitlines()
    fields = [int(x) for x in lines[0].split()[1:9]]
    if not lines[0].startswith("cpu ") or len(fields) < 4:
        raise ValueError("no cpu line in /proc/stat")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    count = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    return sum(fields) - idle, sum(fields), max(1, count)


def memory(meminfo: str) -> tuple[int, int, int]:
    """(used, total, cache) in bytes from /proc/meminfo."""
    kib = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            kib[name] = int(parts[0]) * 1024
    total = kib["MemTotal"]
    return total - kib.get("MemAvailable", kib.get("MemFree", 0)), total, kib.get("Cached", 0) + kib.get("Buffers", 0)


def disk(df: str) -> tuple[int, int]:
    """(used, total) in bytes from ``df -B1 -P /``."""
    parts = df.strip().splitlines()[-1].split()
    return int(parts[2]), int(parts[1])


class GuestProbe:
    """Where the figures come from: the guest, through the session layer (a seam for unit tests,
    whose fake guest reads no files)."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    async def read(self, sandbox_id: str, path: str) -> str:
        download = await self.sessions.read_file(sandbox_id, path)
        data = bytearray()
        async for chunk in download.chunks:
            data += chunk
            if len(data) > MAX_READ:
                raise ValueError(f"{path} is over {MAX_READ} bytes")
        return data.decode("ascii", "replace")

    async def df(self, sandbox_id: str) -> str:
        return (await self.sessions.exec(sandbox_id, CommandSpec(argv=["df", "-B1", "-P", "/"], timeout_s=10))).stdout


class Metrics:
    def __init__(self, sandboxes: E2BSandboxes) -> None:
        self.sandboxes = sandboxes
        self.probe = GuestProbe(sandboxes.runtime.sessions)
        self.history: dict[str, collections.deque[Sample]] = {}
        self._cpu: dict[str, tuple[str, int, int]] = {}  # e2b id → (forkd sandbox, busy, total) last read
        self._disk: dict[str, tuple[float, int, int]] = {}  # e2b id → (when, used, total)
        self._asked: dict[str, float] = {}  # e2b id → when its metrics were last asked for

    async def sample(self, e2b_id: str, live: LiveSandbox) -> Sample:
        """One sample of the running sandbox, kept in its history."""
        sid = live.record.id
        busy, total, count = cpu_times(await self.probe.read(sid, "/proc/stat"))
        last = self._cpu.get(e2b_id)
        if last is None or last[0] != sid:  # a first reading, or a resumed sandbox's counters start anew
            await asyncio.sleep(FIRST_GAP_S)
            last = (sid, busy, total)
            busy, total, count = cpu_times(await self.probe.read(sid, "/proc/stat"))
        self._cpu[e2b_id] = (sid, busy, total)
        pct = 100.0 * (busy - last[1]) / (total - last[2]) if total > last[2] else 0.0
        used, mem_total, cache = memory(await self.probe.read(sid, "/proc/meminfo"))
        when, disk_used, disk_total = self._disk.get(e2b_id, (0.0, 0, 0))
        if time.time() - when >= DISK_S:
            disk_used, disk_total = disk(await self.probe.df(sid))
            self._disk[e2b_id] = (time.time(), disk_used, disk_total)
        sample = Sample(time.time(), count, max(0.0, min(100.0, pct)), used, mem_total, cache, disk_used, disk_total)
        self.history.setdefault(e2b_id, collections.deque(maxlen=HISTORY)).append(sample)
        return sample

    async def round(self) -> None:
        """The keeper's round: sample every running E2B sandbox; drop the history of ended ones."""
        running = {}
        for live in self.sandboxes.runtime.sandboxes.live():
            if not live.killing and OWNER_LABEL in (live.record.meta.get("metadata") or {}):
                running[self.sandboxes.e2b_id(live)] = live
        now = time.time()
        for e2b_id, live in running.items():
            if now - self._asked.get(e2b_id, -WATCH_S) >= WATCH_S:
                continue
            try:
                await self.sample(e2b_id, live)
            except Exception as exc:  # noqa: BLE001 - one sandbox (ending, busy, hostile) never stops the round
                log.debug("no metrics sample of %s: %s", e2b_id, exc)
        for e2b_id in list(self.history):
            if e2b_id not in running and not self.sandboxes.exists(e2b_id):
                for table in (self.history, self._cpu, self._disk, self._asked):
                    table.pop(e2b_id, None)

    async def get(self, principal: Principal, e2b_id: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """E2B's ``SandboxMetric`` list between ``start`` and ``end`` (Unix seconds), oldest first."""
        resolved = self.sandboxes.resolve(e2b_id, principal)
        self._asked[e2b_id] = time.time()
        history = self.history.get(e2b_id)
        if resolved.live is not None and (not history or time.time() - history[-1].at >= METRICS_S):
            try:
                await self.sample(e2b_id, resolved.live)
            except Exception as exc:  # noqa: BLE001 - a guest that cannot be read: the history there is
                log.info("no metrics sample of %s: %s", e2b_id, exc)
        return [s.to_e2b() for s in self.history.get(e2b_id, ())
                if (start is None or s.at >= start) and (end is None or s.at <= end)]

    def latest(self, principal: Principal, e2b_ids: list[str]) -> dict[str, dict[str, Any]]:
        """E2B's ``SandboxesWithMetrics``: the last sample of each named sandbox the caller owns."""
        out = {}
        for e2b_id in e2b_ids:
            try:
                self.sandboxes.resolve(e2b_id, principal)
            except E2BError:  # another owner's, or gone: absent, as E2B answers
                continue
            if self.history.get(e2b_id):
                out[e2b_id] = self.history[e2b_id][-1].to_e2b()
        return {"sandboxes": out}

