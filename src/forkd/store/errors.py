"""What can go wrong with a snapshot in the store; each message says what to do next.

Each carries its kind of ``forkd.errors``, which gives its HTTP status (conflict 409, corrupt 409, disk full
507, the rest 400).
"""

from __future__ import annotations


class SnapshotError(RuntimeError):
    """Creating or using a snapshot failed; the message says what to do."""

    kind = "snapshot_error"


class SnapshotConflict(SnapshotError):
    """The tag is taken or claimed by another request, or the snapshot is in use."""

    kind = "conflict"


class DiskFull(RuntimeError):
    """A filesystem the daemon writes to is (nearly) full: the work was refused before it wrote, or
    what it wrote was removed; the message names the directory and what to free."""

    kind = "disk_full"


class SnapshotDiskFull(DiskFull, SnapshotError):
    """The filesystem holding snapshots ran out of space; nothing was registered or left behind."""

    kind = "disk_full"


class SnapshotCorrupt(SnapshotError):
    """A snapshot file no longer matches the digest recorded when it was saved, or a chain link is gone."""

    kind = "snapshot_corrupt"


class DigestNotFound(LookupError):
    """No ready snapshot of this store has that layer digest (HTTP 404 ``snapshot_not_found``)."""

    kind = "snapshot_not_found"
