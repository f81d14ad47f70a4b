"""What the API answers about snapshots: the listing and one snapshot's details, ``disk`` meaning the same in both
(logical: its files' sizes; physical: the blocks they occupy, each inode once)."""

from __future__ import annotations

from pydantic import Field

from forkd.daemon.schemas import Open


class Snapshot(Open):
    tag: str
    status: str
    image: str
    path: str
    created_at: float


class DiskUsage(Open):
    logical_bytes: int = Field(description="sum of the snapshot's file sizes")
    physical_bytes: int = Field(description="blocks allocated to them, each inode once (holes are free)")


class ListedSnapshot(Snapshot):
    disk: DiskUsage


class SnapshotList(Open):
    snapshots: list[ListedSnapshot]


class DescribedSnapshot(ListedSnapshot):
    """``GET /v1/snapshots/{tag}``: the listing's fields (``disk`` meaning the same) and its chain."""
    depth: int = Field(description="ancestors below it (0: a full snapshot)")
    ancestors: list[str] = Field(description="parent first")
    dependents: list[str] = Field(description="snapshots branched from it directly")
    all_dependents: list[str]
    own_bytes: int = Field(description="blocks only it holds (no hard links into the image cache)")
    chain_bytes: int = Field(description="own_bytes of it and every ancestor")
