"""The daemon's keepers: background rounds over the running VMMs that no error of one round ends.

The deadline keeper kills sandboxes past their timeout; the idle keeper stops children idle long
enough (runtime/idle.py); the console keeper cuts consoles that grow
past their bound: those of live sandboxes and of parents being baked into snapshots (a parent may
boot and warm for up to 15 minutes, its guest writing its serial port all the while). Each must
outlive any error of one round, or what it enforces would stop being enforced without anyone noticing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from forkd.runtime.idle import IdleStops
from forkd.runtime.sandboxes import SandboxService
from forkd.vmm.base import VmHandle

CONSOLE_MAX_BYTES = 16 << 20  # a live sandbox's console is cut past this (see VmHandle.bound_logs)
IDLE_CHECK_MAX_S = 5.0  # how often idle children are looked for, at most
LOG_CHECK_S = 5.0  # how often: a console can outgrow the bound by what a guest writes in this time
log = logging.getLogger("forkd.keepers")


async def deadline_keeper(sandboxes: SandboxService, interval_s: float = 1.0) -> None:
    """A sandbox outlives its timeout by at most ``interval_s``."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await sandboxes.expire()
        except Exception:
            log.exception("the deadline keeper's round failed; it goes on")


async def idle_keeper(idle: IdleStops, interval_s: float | None = None) -> None:
    """Stop idle children; a child is stopped at most ``interval_s`` (a fifth of the idle time, at most
    ``IDLE_CHECK_MAX_S``) after it became idle for long enough."""
    if idle.idle_s <= 0:
        return
    interval_s = interval_s or min(IDLE_CHECK_MAX_S, max(0.05, idle.idle_s / 5))
    while True:
        await asyncio.sleep(interval_s)
        try:
            await idle.sweep()
        except Exception:
            log.exception("the idle keeper's round failed; it goes on")


async def console_keeper(consoles: Callable[[], Iterable[VmHandle]], interval_s: float = LOG_CHECK_S,
                         max_bytes: int = CONSOLE_MAX_BYTES) -> None:
    """Keep the console of every VMM ``consoles()`` names (``Runtime.consoles``: live sandboxes and
    parents being baked) under ``max_bytes``: a guest writing its serial port without end must not
    fill the host's disk."""
    told: set[str] = set()  # VMs whose cut was logged (a VMM started without append=on is cut each round)
    while True:
        await asyncio.sleep(interval_s)
        try:
            handles = list(consoles())
            cut = await asyncio.to_thread(lambda: [vm.name for vm in handles if vm.bound_logs(max_bytes)])
        except Exception:
            log.exception("bounding the consoles failed; trying again")
            continue
        for name in set(cut) - told:
            log.info("%s: its console passed %d bytes and was cut to its end", name, max_bytes)
        told = (told | set(cut)) & {vm.name for vm in handles}
