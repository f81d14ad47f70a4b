"""The daemon's free-space floor: work that writes to the host's disk starts only when it fits and
leaves the floor.

Forks (their disk overlays), branches, snapshot builds, uploads (their spool), packs, unpacks and
pulls check the filesystem they write to first and refuse with ``disk_full`` (HTTP 507), naming
what to free; a stream of unknown length checks again as it grows. Guests whose disk fills anyway
get I/O errors (the VMM reports them to the guest instead of pausing it), and the next fork is
refused here. The floor is ``[disk] min_free_mib``.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from forkd.store.errors import DiskFull

MIB = 1 << 20
DEFAULT_FLOOR_BYTES = 1 << 30
RECHECK_EVERY_BYTES = 64 << 20  # a growing stream looks at the free space again after this much
FLOOR_KEY = "[disk] min_free_mib"


@dataclass(frozen=True)
class SpaceFloor:
    floor_bytes: int = DEFAULT_FLOOR_BYTES
    packs_dir: Path | None = None  # where old pack files may be freed, named in the message

    def _what_to_free(self) -> str:
        packs = f", old pack files under {self.packs_dir}" if self.packs_dir is not None else ""
        return f"unused snapshots with `forkd rmi TAG`, idle sandboxes with `forkd kill ID`{packs}"

    def check(self, directory: Path, needed: int, what: str) -> None:
        """Refuse ``what`` unless ``directory``'s filesystem has ``needed`` bytes free above the floor."""
        free = shutil.disk_usage(directory).free
        if free >= needed + self.floor_bytes:
            return
        needs = f"needs up to {_mib(needed)} MiB under {directory} and" if needed else f"writes under {directory};"
        raise DiskFull(
            f"disk full: {what} {needs} the daemon keeps {_mib(self.floor_bytes)} MiB free (`{FLOOR_KEY}`), "
            f"but only {_mib(free)} MiB are free; free space there ({self._what_to_free()}) and try again")

    @contextlib.contextmanager
    def reported(self, directory: Path, what: str) -> Iterator[None]:
        """Running out of space anyway (another writer took it meanwhile) is ``disk_full`` too, not an
        internal error; the caller has already removed what it wrote."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise DiskFull(f"disk full under {directory} while {what} ({exc.strerror}); nothing was kept. "
                           f"Free space there ({self._what_to_free()}) and try again") from None

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
