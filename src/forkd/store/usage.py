"""How much a directory holds: its files' logical size and the blocks they really occupy.

A snapshot's memory file is mostly holes and its base files are hard links into the image cache,
so the two figures differ a lot; each inode is counted once.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def directory_usage(path: Path) -> dict[str, int]:
    """``{"logical_bytes", "physical_bytes"}`` of the regular files under ``path`` (0 if it is gone)."""
    seen: set[tuple[int, int]] = set()
    logical = physical = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            logical += st.st_size
            physical += st.st_blocks * 512
    return {"logical_bytes": logical, "physical_bytes": physical}
