"""Progress lines of long operations (image builds, snapshots, packs), as the SDK hands them to ``on_progress``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ProgressLine(str):
    """A progress line as text, with ``done_bytes``/``total_bytes`` when the daemon counted bytes (packs,
    pulls, pushes; ``total_bytes`` None when the size is unknown), else both None."""

    done_bytes: int | None
    total_bytes: int | None

    def __new__(cls, text: str, done_bytes: int | None = None, total_bytes: int | None = None) -> ProgressLine:
        line = super().__new__(cls, text)
        line.done_bytes, line.total_bytes = done_bytes, total_bytes
        return line


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def progress(on_progress: Callable[[str], Any] | None) -> Callable[[dict[str, Any]], Any] | None:
    if on_progress is None:
        return None
    return lambda line: on_progress(ProgressLine(str(line.get("progress", line)), _count(line.get("done_bytes")),
                                                 _count(line.get("total_bytes"))))
