"""A snapshot's disk, as its VMM backend stores it: the seam between a backend's disk format and
the store, packs and runtime, which never name the format.

Every snapshot holds one disk layer, :attr:`DiskFormat.file_name`. A baked snapshot's layer lies
over the raw base image next to it (``base.ext4``); a branch's holds what its source wrote since
the parent and lies over ``../<parent tag>/<file_name>``; both name what they lie over by relative
path, so a store can be moved or packed. A compacted snapshot's layer is flattened onto the raw
base again. A VM never writes a snapshot's layer: it gets its own disk over it in its run
directory. How those references are recorded, checked and followed is the backend's alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol


class UnsafeDisk(ValueError):
    """A disk file from elsewhere (a pack) is malformed or refers to a file outside its snapshot chain."""

    kind = "pack_refused"


class DiskFormat(Protocol):
    """How a backend keeps disks: names, layers over layers, export, flattening, checking."""

    file_name: str  # a snapshot's disk layer in its directory (QEMU: ``disk.qcow2``)

    async def new_root(self, base: Path, disk: Path) -> None:
        """An empty disk a parent boots on and its snapshot keeps, over the raw image ``base``
        (in the same directory, recorded by name)."""
        ...

    async def new_child(self, layer: Path, disk: Path) -> None:
        """A child's writable disk over a snapshot's ``layer``, which stays untouched."""
        ...

    async def export_layer(self, frozen: Path, dest: Path, backing_name: str | None) -> None:
        """Copy a VM's frozen disk layer (a BRANCH's) into a snapshot as ``dest``, lying over
        ``backing_name`` (relative to ``dest``: ``../<parent tag>/<file_name>``); ``None``: a layer with no
        parent snapshot to lie over, which takes in what the VM's earlier layers hold and is flattened next."""
        ...

    async def flatten(self, disk: Path, base_name: str) -> None:
        """Make ``disk`` (writable) hold everything its chain of layers held, over the raw image
        ``base_name`` next to it alone (compaction)."""
        ...

    def check_packed(self, path: Path, own_files: set[str], ancestors: Mapping[str, set[str]]) -> None:
        """Refuse (:class:`UnsafeDisk`) a file of a snapshot arriving in a pack that the backend would
        follow outside its chain (:func:`require_in_chain`). Called for every content file of the
        pack before the backend ever opens one."""
        ...


def require_in_chain(path: Path, reference: str, own_files: set[str], ancestors: Mapping[str, set[str]]) -> None:
    """Refuse a disk layer from a pack whose backing ``reference`` names anything but a file of its own
    snapshot (``own_files``) or ``../<tag>/<file>`` of an ancestor in its chain (``ancestors``: tag → files)."""
    parts = reference.split("/")
    if (len(parts) == 1 and parts[0] in own_files) or (
            len(parts) == 3 and parts[0] == ".." and parts[2] in ancestors.get(parts[1], set())):
        return
    raise UnsafeDisk(f"{path.parent.name}/{path.name} is backed by {reference!r}: a disk in a pack may only be "
                     "backed by a file of its own snapshot or '../<ancestor tag>/<file>' of its chain")
