"""One daemon per state directory: a lock file in ``FORKD_HOME`` held for the daemon's whole life.

The socket alone guards nothing when two daemons are given different sockets (a systemd daemon on
/run/forkd/forkd.sock and a CLI-started one on HOME/forkd.sock): both would recover, reap and serve
the same state.db and run directories. ``flock`` is released by the kernel when the process dies,
so a crashed daemon never leaves a lock to clean up; the file names the holder for the refusal.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

LOCK_NAME = "daemon.lock"


class DaemonAlreadyRunning(RuntimeError):
    """Another daemon serves this state directory (or listens on this socket); the message names it."""


class HomeLock:
    """The held lock; ``release`` (or process exit) frees it."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    @classmethod
    def acquire(cls, home: Path, socket: Path) -> HomeLock:
        """Lock ``home`` for this process and record its pid and ``socket``, or say who holds it."""
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = home / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise DaemonAlreadyRunning(
                f"another forkd daemon (pid {holder.get('pid', '?')}, socket {holder.get('socket', '?')}) already "
                f"serves {home}; talk to it (FORKD_SOCKET={holder.get('socket', '?')}), stop it first, "
                f"or give this one another FORKD_HOME") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "socket": str(socket)}).encode() + b"\n", 0)
        return cls(fd, path)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = -1


def _holder(fd: int) -> dict[str, object]:
    """What the holding daemon wrote (bounded; a torn or foreign file reads as unknown)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
