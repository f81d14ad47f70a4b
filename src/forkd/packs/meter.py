"""Progress over a known number of bytes (packing, verifying, downloading, uploading), as lines that also
carry their counts."""

from __future__ import annotations

import time
from collections.abc import Callable

Progress = Callable[[str], None]
PROGRESS_EVERY_S = 2.0


class Measured(str):
    """A progress line that also carries its byte counts, so a client can draw a bar with speed and ETA
    (the daemon sends them as ``done_bytes``/``total_bytes`` next to the text: daemon/ndjson.py)."""

    done: int
    total: int | None

    def __new__(cls, text: str, done: int, total: int | None) -> Measured:
        line = super().__new__(cls, text)
        line.done, line.total = done, total
        return line


class Meter:
    """Progress over a known number of bytes, reported at most every couple of seconds."""

    def __init__(self, progress: Progress, verb: str, total: int) -> None:
        self.progress, self.verb, self.total = progress, verb, total
        self.done = 0
        self._last = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= PROGRESS_EVERY_S:
            self._last = now
            self.progress(self.line())

    def line(self) -> Measured:
        if not self.total:  # e.g. a download whose size nobody announced
            return Measured(f"{self.verb} {self.done / 2**20:.0f} MiB", self.done, None)
        return Measured(f"{self.verb} {self.done / 2**20:.0f} of {self.total / 2**20:.0f} MiB "
                        f"({100 * self.done / self.total:.0f}%)", self.done, self.total)
