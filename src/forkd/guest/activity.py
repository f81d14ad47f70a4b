"""activity and clock.set: what the host asks before it stops an idle guest, and after it continues one.

A host may stop (QMP ``stop``) a guest nobody has asked anything for a while, so an idle child costs
no CPU. It must not stop one that works on its own: a command started in the background, a server,
a PTY, a directory watch. ``activity`` names them: every user-space process that is not the agent's
own (PID 1, the agent, the warm template and its run_code contexts), and the open watches. A stopped
guest's clock stands still, so after ``cont`` the host sets it with ``clock.set``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import protocol, reseed
from .dispatch import Handler, Request, inline

MAX_LISTED = 16  # user processes named in an answer (their count is exact)


def user_processes(own: Iterable[int], proc: str = "/proc") -> list[int]:
    """Pids of user-space processes (a command line; kernel threads and zombies have none) not in ``own``."""
    skip = set(own)
    found = []
    for name in os.listdir(proc):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"{proc}/{name}/cmdline", "rb") as f:
                if f.read(1):
                    found.append(int(name))
        except OSError:  # it ended while we looked
            continue
    return sorted(found)


class ActivityOps:
    def __init__(self, own_pids: Callable[[], Iterable[int]], watches: Callable[[], int]) -> None:
        self._own_pids = own_pids
        self._watches = watches

    def handlers(self) -> dict[str, Handler]:
        return {protocol.OP_ACTIVITY: self.activity, protocol.OP_CLOCK_SET: self.clock_set}

    def shutdown(self) -> None:
        pass

    def activity(self, req: Request) -> dict[str, Any]:
        pids = user_processes({1, os.getpid(), *self._own_pids()})
        return {"processes": len(pids), "pids": pids[:MAX_LISTED], "watches": self._watches()}

    @inline
    def clock_set(self, req: Request) -> dict[str, Any]:
        time_ns = req.arg("time_ns", int, minimum=0)
        skipped: list[str] = []
        reseed.attempt("clock", skipped, time.clock_settime_ns, time.CLOCK_REALTIME, time_ns)
        return {"clock": not skipped}
