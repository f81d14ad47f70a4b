"""E2B's ``lifecycle``: a sandbox whose timeout expires is paused instead of killed, and with
``autoResume`` the next request to it resumes it.

The policy is stored with the sandbox as labels (``forkd.e2b-on-timeout``, ``forkd.e2b-auto-resume``,
``forkd.e2b-timeout``: the timeout it was created with, which a resume by traffic grants again,
``forkd.e2b-pause-at``: when the running sandbox is paused), so it survives pause/resume (a pause carries labels into the workspace) and
daemon restarts. Such a sandbox has no runtime deadline: the runtime would kill it, and forkd's pause
is a diff BRANCH that keeps everything. Time paused counts against nothing: a resume grants the
timeout again from the moment it runs.

:class:`Keeper` runs the rounds: pause what is due, collect E2B's unreferenced layers, sample
metrics. Each round's errors are logged; the next round tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from forkd.e2b.errors import E2BError

ON_TIMEOUT_LABEL = "forkd.e2b-on-timeout"
AUTO_RESUME_LABEL = "forkd.e2b-auto-resume"
TIMEOUT_LABEL = "forkd.e2b-timeout"
PAUSE_AT_LABEL = "forkd.e2b-pause-at"
ROUND_S = 1.0  # a sandbox is paused at most this long after its timeout
log = logging.getLogger("forkd.e2b.lifecycle")


@dataclass(frozen=True)
class Policy:
    """What happens when the sandbox's timeout expires, and whether traffic resumes it."""

    pause: bool = False
    auto_resume: bool = False

    @classmethod
    def from_request(cls, auto_pause: bool | None, auto_pause_memory: bool | None,
                     auto_resume: Any) -> Policy:
        """The create request's ``autoPause``, ``autoPauseMemory`` and ``autoResume`` (``{"enabled": b}``)."""
        enabled = auto_resume.get("enabled") if isinstance(auto_resume, Mapping) else auto_resume
        if enabled is not None and not isinstance(enabled, bool):
            raise E2BError(400, "autoResume must be {\"enabled\": true|false}")
        if auto_pause and auto_pause_memory is False:
            raise E2BError(400, "autoPauseMemory: false (on_timeout mode \"filesystem\") is not served: forkd pauses "
                                "with a diff BRANCH that keeps memory and disk, and its guests cannot cold-boot from "
                                "the disk alone; leave mode unset or \"full\"")
        if enabled and not auto_pause:
            raise E2BError(400, "autoResume needs autoPause (lifecycle on_timeout \"pause\")")
        return cls(pause=bool(auto_pause), auto_resume=bool(enabled))

    @classmethod
    def of(cls, labels: Mapping[str, str]) -> Policy:
        return cls(pause=labels.get(ON_TIMEOUT_LABEL) == "pause", auto_resume=labels.get(AUTO_RESUME_LABEL) == "1")

    def labels(self, timeout_s: int) -> dict[str, str]:
        """The labels a new sandbox with this policy carries (none for E2B's default, kill)."""
        if not self.pause:
            return {}
        return {ON_TIMEOUT_LABEL: "pause", AUTO_RESUME_LABEL: "1" if self.auto_resume else "0",
                TIMEOUT_LABEL: str(int(timeout_s)), **timed(timeout_s)}

    def describe(self) -> dict[str, Any]:
        """E2B's ``SandboxLifecycle`` (sandbox info)."""
        return {"onTimeout": "pause" if self.pause else "kill", "autoResume": self.auto_resume}


def timed(timeout_s: int, now: float | None = None) -> dict[str, str]:
    """The label of a pausing sandbox's deadline: ``timeout_s`` from ``now``."""
    now = time.time() if now is None else now
    return {PAUSE_AT_LABEL: f"{now + timeout_s:.3f}"}


def pause_at(labels: Mapping[str, str]) -> float | None:
    raw = labels.get(PAUSE_AT_LABEL)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def granted(labels: Mapping[str, str]) -> int:
    """The seconds a resume by traffic grants: the timeout the sandbox was created with (as E2B does;
    a ``set_timeout`` moves this run's deadline only)."""
    try:
        return max(0, int(labels.get(TIMEOUT_LABEL, "")))
    except ValueError:
        return 0


class Keeper:
    """The E2B front's background rounds, each its own task so one slow round never delays another."""

    def __init__(self, rounds: dict[str, tuple[float, Callable[[], Awaitable[Any]]]]) -> None:
        self.rounds = rounds  # name → (interval, one round)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._loop(name, every, step), name=f"e2b-{name}")
                           for name, (every, step) in self.rounds.items()]

    @property
    def running(self) -> bool:
        return bool(self._tasks) and not any(task.done() for task in self._tasks)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    @staticmethod
    async def _loop(name: str, interval_s: float, step: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await step()
            except Exception:
                log.exception("the E2B front's %s round failed; it goes on", name)
