"""Partial pack outputs: where a pack is written before it is renamed into place, and their removal.

A pack is written to ``.<name>.partial-<8 hex>`` next to its output and renamed when complete, so a
reader never sees half a pack; a daemon killed mid-pack leaves that file behind, and the next one
removes it at startup (nothing can be packing then). Only names this scheme makes are touched.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

_PARTIAL = re.compile(r"^\..+\.partial-[0-9a-f]{8}$")


def partial_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.partial-{secrets.token_hex(4)}")


def remove_partials(root: Path) -> list[Path]:
    """Remove the partial outputs an interrupted pack left under ``root``: regular files named as
    :func:`partial_path` names them and owned by this user, never links or directories. Returns them."""
    removed = []
    for directory, _, names in os.walk(root):  # os.walk does not follow symbolic links to directories
        for name in names:
            if not _PARTIAL.match(name):
                continue
            path = Path(directory) / name
            try:
                info = path.lstat()
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                    path.unlink()
                    removed.append(path)
            except OSError:  # gone meanwhile, or not ours to remove: leave it
                continue
    return removed
