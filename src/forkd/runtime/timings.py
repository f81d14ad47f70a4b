"""Stage timings of one operation (a spawn, a BRANCH, a traced request): where each millisecond went.

A mark costs one ``time.monotonic()`` call and a list append, so every request records them; the
answer carries them as ``timings`` and the metrics observe one histogram sample per stage.

A request through the daemon is traced only when its client asks (``daemon/middleware/timing.py``):
the Timings then travel with the request's task in :data:`CURRENT`, so the layers it passes
(sessions, the agent client) mark their stages without being handed anything, and the agent client
asks the guest for its own marks (``trace``), kept apart in :attr:`Timings.elsewhere` since the
guest's clock is not the host's.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Protocol


class _StageHistogram(Protocol):
    def labels(self, *values: str) -> _Observer: ...


class _Observer(Protocol):
    def observe(self, amount: float) -> None: ...


class Timings:
    """Monotonic marks, each ending a named stage that began at the previous mark (or at creation)."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.monotonic() if start is None else start
        self._marks: list[tuple[str, float]] = []
        self.elsewhere: dict[str, float] = {}  # seconds of stages timed on another clock (the guest's)
        self.closed = False

    def mark(self, stage: str, at: float | None = None) -> None:
        """The stage ``stage`` ended now (or at ``at``, a monotonic time taken earlier); nothing once closed."""
        if not self.closed:
            self._marks.append((stage, time.monotonic() if at is None else at))

    def close(self) -> None:
        """No more marks: a task started while a traced request ran (a sandbox's reader, a keeper) keeps
        the request's context, and with it these Timings, for as long as it lives."""
        self.closed = True

    def stages(self) -> dict[str, float]:
        """Seconds each stage took, in the order they ended; a stage marked twice adds up."""
        spent: dict[str, float] = {}
        previous = self.start
        for stage, at in self._marks:
            spent[stage] = spent.get(stage, 0.0) + at - previous
            previous = at
        return spent

    def between(self, first: str, last: str) -> float:
        """Seconds from the end of the stage before ``first`` to the end of ``last``."""
        names = [stage for stage, _ in self._marks]
        i, j = names.index(first), len(names) - 1 - names[::-1].index(last)
        began = self._marks[i - 1][1] if i else self.start
        return self._marks[j][1] - began

    @property
    def total(self) -> float:
        return (self._marks[-1][1] if self._marks else self.start) - self.start

    def as_ms(self) -> dict[str, float]:
        """What an API answer carries: milliseconds per stage and in total, rounded to 0.01 ms."""
        return {**{stage: round(s * 1000, 2) for stage, s in self.stages().items()},
                **{stage: round(s * 1000, 2) for stage, s in self.elsewhere.items()},
                "total": round(self.total * 1000, 2)}

    def observe(self, histogram: _StageHistogram, *labels: str) -> None:
        """One sample per stage into a histogram whose last label is the stage (after ``labels``)."""
        for stage, seconds in self.stages().items():
            histogram.labels(*labels, stage).observe(seconds)


#: The Timings of the traced request this task serves (None: not traced, nothing is marked).
CURRENT: ContextVar[Timings | None] = ContextVar("forkd_request_timings", default=None)


def current() -> Timings | None:
    """The Timings of the traced request this task serves, if it still runs."""
    timings = CURRENT.get()
    return None if timings is None or timings.closed else timings


def mark(stage: str) -> None:
    """Mark ``stage`` on the current request's Timings, if it is traced."""
    timings = current()
    if timings is not None:
        timings.mark(stage)
