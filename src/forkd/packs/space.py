"""The free-space floor packs keep: a pack job starts only when what it may write fits and leaves the floor.

A full disk pauses every VM writing to it (and SQLite with them), so packing, unpacking and pulling
check the filesystem they write to first, refusing with ``disk_full`` (HTTP 507) and naming what to
free; a download of unknown size checks again as it grows. The floor is ``[packs] min_free_mib``.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from forkd.store.errors import SnapshotDiskFull

MIB = 1 << 20
DEFAULT_FLOOR_BYTES = 1 << 30
RECHECK_EVERY_BYTES = 64 << 20  # a growing download looks at the free space again after this much


@dataclass(frozen=True)
class SpaceFloor:
    floor_bytes: int = DEFAULT_FLOOR_BYTES
    packs_dir: Path | None = None  # where old pack files may be freed, named in the message

    def check(self, directory: Path, needed: int, what: str) -> None:
        """Refuse ``what`` unless ``directory``'s filesystem has ``needed`` bytes free above the floor."""
        free = shutil.disk_usage(directory).free
        if free >= needed + self.floor_bytes:
            return
        packs = f", old pack files under {self.packs_dir}" if self.packs_dir is not None else ""
        raise SnapshotDiskFull(
            f"disk full: {what} needs up to {_mib(needed)} MiB under {directory} and the daemon keeps "
            f"{_mib(self.floor_bytes)} MiB free (`[packs] min_free_mib`), but only {_mib(free)} MiB are free; "
            f"free space there (unused snapshots with `forkd rmi TAG`{packs}) and try again")

    @contextlib.contextmanager
    def reported(self, directory: Path, what: str) -> Iterator[None]:
        """Running out of space anyway (another writer took it meanwhile) is ``disk_full`` too, not an
        internal error; the caller has already removed what it wrote."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            packs = f", old pack files under {self.packs_dir}" if self.packs_dir is not None else ""
            raise SnapshotDiskFull(f"disk full under {directory} while {what} ({exc.strerror}); nothing was kept. "
                                   f"Free space there (unused snapshots with `forkd rmi TAG`{packs}) and try "
                                   "again") from None

    def watch(self, directory: Path, what: str) -> Callable[[int], None]:
        """A callback for a stream of unknown length: given each chunk's size, it checks the floor again
        every ``RECHECK_EVERY_BYTES`` (the bytes already written are on the disk, so it needs no more)."""
        pending = 0

        def written(n: int) -> None:
            nonlocal pending
            pending += n
            if pending >= RECHECK_EVERY_BYTES:
                pending = 0
                self.check(directory, 0, what)
        return written


def _mib(n: int) -> str:
    return f"{n / MIB:.0f}"
