"""The unprivileged uids VMMs run as: one each, from a configured range, like Firecracker's jailer.

A VMM's uid (its gid has the same number) is reserved before its process starts, bound to the
process once it has a pid, and free again when that process has exited. Nothing is persisted: a
restarted daemon re-learns who holds which uid from ``/proc`` (any live process whose real uid is
in the range holds it, a VMM the previous daemon left or anything else), and a holder is checked by
pid *and* start time, so a reused pid never keeps a uid taken. Daemons sharing a host (a cluster's
nodes, tests) also hold each uid they hand out as a byte lock in one host-wide file
(:data:`CLAIMS`), so two of them never give one uid to two VMMs.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from forkd.vmm.base import VmmError
from forkd.vmm.process import start_time

#: Far above the ids Debian gives users (1000-59999), subordinate ids (100000 + 65536·n) and
#: systemd's dynamic and container ranges (up to 1879048191), inside the range systemd leaves unused.
DEFAULT_UID_RANGE = "1900000000-1900065535"
#: One byte lock per uid (at offset uid) for every daemon of the host; under /run/forkd, which
#: the systemd unit keeps writable.
CLAIMS = Path("/run/forkd/vmm-uids.lock")
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
_MAX_ID = (1 << 32) - 2  # (uid_t)-1 means "no change" to set*id


class UidRangeError(ValueError):
    """A uid range that is malformed, privileged or already used on this host."""


@dataclass(frozen=True)
class UidRange:
    first: int
    last: int

    @classmethod
    def parse(cls, text: str) -> UidRange:
        """``"FIRST-LAST"``, inclusive; uid 0 and ``(uid_t)-1`` are refused."""
        match = _RANGE.match(text)
        if match is None:
            raise UidRangeError(f"uid range {text!r} is not FIRST-LAST (e.g. {DEFAULT_UID_RANGE!r})")
        first, last = int(match[1]), int(match[2])
        if not 0 < first <= last <= _MAX_ID:
            raise UidRangeError(f"uid range {text!r} must satisfy 0 < FIRST <= LAST <= {_MAX_ID}")
        return cls(first, last)

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


def host_conflicts(ids: UidRange, etc: Path = Path("/etc")) -> list[str]:
    """Where this host already uses an id of the range: users, groups and subordinate id ranges."""
    found = []
    for name in ("passwd", "group"):
        for line in _lines(etc / name):
            fields = line.split(":")
            if len(fields) > 2 and fields[2].isdigit() and int(fields[2]) in ids:
                found.append(f"{name} entry {fields[0]!r} ({fields[2]})")
    for name in ("subuid", "subgid"):
        for line in _lines(etc / name):
            fields = line.split(":")
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                start, count = int(fields[1]), int(fields[2])
                if start <= ids.last and start + count - 1 >= ids.first:
                    found.append(f"{name} range of {fields[0]!r} ({start}-{start + count - 1})")
    return found


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    except FileNotFoundError:
        return []


def real_uid(pid: int) -> int | None:
    """The real uid of ``pid`` from ``/proc/PID/status``; None when it no longer exists."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def live_holders(ids: UidRange) -> Iterable[tuple[int, int, int]]:
    """``(uid, pid, start time)`` of every live process whose real uid is in ``ids``."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            uid = real_uid(pid)
            started = start_time(pid) if uid in ids else None
            if uid is not None and started is not None:
                yield uid, pid, started


_PENDING = (0, 0)  # reserved for a VMM whose process is being started


class UidAllocator:
    """Hands out each uid of a range to one VMM at a time. Thread-safe: VMMs start on a thread."""

    def __init__(self, ids: UidRange,
                 scan: Callable[[UidRange], Iterable[tuple[int, int, int]]] = live_holders,
                 started: Callable[[int], int | None] = start_time, claims: Path | None = None) -> None:
        """``claims``: the host-wide lock file other daemons claim uids in too (None: this allocator alone)."""
        self.ids = ids
        self._scan = scan
        self._started = started
        self._claims_path = claims
        self._claims = -1  # its descriptor, opened on the first allocation
        self._held: dict[int, tuple[int, int]] = {}  # uid → (pid, start time) of its holder, or _PENDING
        self._next = ids.first
        self._learned = False
        self._lock = threading.Lock()

    def learn(self) -> None:
        """Who holds which uid already (a scan of ``/proc``) and the host-wide claims file: once, before
        the first allocation. The daemon calls it off its event loop at start (the backend's warm-up)."""
        with self._lock:
            self._learn()

    def _learn(self) -> None:
        if self._learned:
            return
        self._learned = True
        for uid, pid, started in self._scan(self.ids):
            self._held[uid] = (pid, started)
        if self._claims_path is not None:
            self._claims_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._claims = os.open(self._claims_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def allocate(self) -> int:
        """A uid no live process holds, reserved until :meth:`bind` or :meth:`release`."""
        with self._lock:
            self._learn()  # the first allocation after a (re)start, unless learned already
            for _ in range(len(self.ids)):
                uid = self._next
                self._next = uid + 1 if uid < self.ids.last else self.ids.first
                holder = self._held.get(uid)
                free = holder is None or (holder != _PENDING and self._started(holder[0]) != holder[1])
                if free and self._claim(uid, fcntl.LOCK_EX | fcntl.LOCK_NB):
                    self._held[uid] = _PENDING
                    return uid
            raise VmmError(f"every VMM uid of the range {self.ids} ({len(self.ids)}) is held by a live process; "
                           "stop sandboxes or widen `uid_range` under [confinement] in the daemon config")

    def bind(self, uid: int, pid: int) -> None:
        """``uid`` is now held by process ``pid`` (checked by its start time from now on)."""
        started = self._started(pid)
        if started is None:  # already gone
            self.release(uid)
            return
        with self._lock:
            self._held[uid] = (pid, started)

    def release(self, uid: int) -> None:
        with self._lock:
            self._held.pop(uid, None)
            self._claim(uid, fcntl.LOCK_UN)

    def _claim(self, uid: int, operation: int) -> bool:
        """Take (or give back) ``uid``'s byte lock in the host-wide file; False if another daemon holds it."""
        if self._claims < 0:
            return True
        try:
            fcntl.lockf(self._claims, operation, 1, uid)  # by the uid itself: daemons' ranges may differ
        except OSError:  # EAGAIN/EACCES: another process holds it
            return False
        return True

    def held(self) -> dict[int, tuple[int, int]]:
        """uid → (pid, start time) of each holder known (pending reservations as ``(0, 0)``)."""
        with self._lock:
            return dict(self._held)
