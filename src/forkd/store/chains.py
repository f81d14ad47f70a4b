"""Snapshot chains: each branch records its parent; a child of a branch needs every link below it.

A link's parent is its registry record's ``parent_tag`` and nothing else (``meta.json`` does not
hold it); the pack manifest carries it between hosts.

A chain is walked from the snapshot down to its root (a baked snapshot, no parent). Its memory is
the nearest ``full`` memory file on the way down with the ``diff`` layers above it laid over it; its
disk is the chain of disk layers (each link's names its parent's by relative path, in the VMM
backend's format; the store only knows the layer's file name, ``disk_file``).
Every link records the digests of its parent's memory and disk layers, so a parent replaced under
the same tag is noticed, not silently used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.store.layout import LAYER_FILE, MEMORY_FILE, memory_layer_name
from forkd.store.pending import PENDING, DigestPending
from forkd.store.registry import Registry, SnapshotRecord
from forkd.store.usage import directory_usage


class ChainBroken(LookupError):
    """A link of a chain is missing (removed with ``rmi --force``) or was replaced."""


@dataclass(frozen=True)
class ChainMemory:
    base: Path  # a full memory file
    layers: tuple[Path, ...]  # diff layers above it, base first


def layer_digest(file_digests: dict[str, str]) -> str:
    """One SHA-256 naming a snapshot's content: over its sorted ``name=sha256`` lines.

    It names a snapshot wherever it is (tags are one store's names): packs and peers move layers by
    it. A child layer records its parent's digest, so a parent replaced by other content is noticed
    whether it comes from the pack or from the store.
    """
    if PENDING in file_digests.values():
        raise DigestPending(f"the digests of {', '.join(n for n, d in sorted(file_digests.items()) if d == PENDING)} "
                            "are still being computed; wait for them (PendingDigests) before naming the snapshot")
    lines = "".join(f"{name}={digest}\n" for name, digest in sorted(file_digests.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def record_digest(record: SnapshotRecord) -> str:
    """The layer digest of a registered snapshot."""
    return layer_digest(record.meta["sha256"])


def parent_digests(parent: SnapshotRecord, disk_file: str) -> dict[str, str]:
    """What a branch records of its parent (its memory and disk layers) so that a replaced parent is refused."""
    digests = parent.meta["sha256"]
    names = (memory_layer_name(parent.meta), disk_file)
    if any(digests.get(name) == PENDING for name in names):
        raise DigestPending(f"snapshot {parent.tag!r}'s digests are still being computed; wait for them first")
    missing = [name for name in names if name not in digests]
    if missing:
        raise ChainBroken(f"snapshot {parent.tag!r} has no {' or '.join(missing)}: it was saved by another VMM "
                          f"backend ({parent.meta.get('identity', {}).get('vmm', 'unknown')}) than this daemon's")
    return {name: digests[name] for name in names}


def ancestry(registry: Registry, record: SnapshotRecord, disk_file: str) -> list[SnapshotRecord]:
    """``record`` and its ancestors, top first; raises if a link is missing or was replaced."""
    chain = [record]
    seen = {record.tag}
    while chain[-1].parent_tag is not None:
        child = chain[-1]
        parent = registry.get_snapshot(child.parent_tag)
        if parent is None or parent.status != "ready":
            state = "missing" if parent is None else parent.status
            raise ChainBroken(f"snapshot {child.tag!r} needs its parent {child.parent_tag!r}, which is {state}; "
                              f"remove {child.tag!r} with `forkd rmi {child.tag}`")
        if parent.tag in seen:
            raise ChainBroken(f"snapshot chain of {record.tag!r} loops at {parent.tag!r}")
        recorded = child.meta.get("parent_sha256", {})
        if recorded != parent_digests(parent, disk_file):
            raise ChainBroken(f"snapshot {child.tag!r} was branched from another {parent.tag!r} than the one "
                              f"registered now; remove {child.tag!r} with `forkd rmi {child.tag}`")
        seen.add(parent.tag)
        chain.append(parent)
    return chain


def chain_memory(chain: list[SnapshotRecord]) -> ChainMemory:
    """The base memory file and layers a child of ``chain[0]`` maps."""
    layers: list[Path] = []
    for link in chain:
        if memory_layer_name(link.meta) == MEMORY_FILE:
            return ChainMemory(base=link.path / MEMORY_FILE, layers=tuple(reversed(layers)))
        layers.append(link.path / LAYER_FILE)
    raise ChainBroken(f"snapshot chain of {chain[0].tag!r} has no full memory file at its root")


def descendants(registry: Registry, tag: str) -> list[str]:
    """Every snapshot branched (directly or not) from ``tag``, deepest first: a safe removal order."""
    found: list[str] = []
    seen = {tag}
    frontier = [tag]
    while frontier:
        children = [c for t in frontier for c in registry.snapshot_children(t) if c not in seen]
        seen.update(children)
        found.extend(children)
        frontier = children
    return list(reversed(found))


def registered_ancestors(registry: Registry, record: SnapshotRecord) -> list[SnapshotRecord]:
    """``record``'s ancestors as registered, parent first, up to the first missing link or the first one
    seen twice (a layer branched to the tag of its own removed parent names itself as parent; no
    checks, no file I/O)."""
    ancestors: list[SnapshotRecord] = []
    seen = {record.tag}
    link = record
    while (tag := link.parent_tag) is not None and tag not in seen and (parent := registry.get_snapshot(tag)) is not None:
        ancestors.append(parent)
        seen.add(parent.tag)
        link = parent
    return ancestors


def describe_chain(registry: Registry, record: SnapshotRecord) -> dict[str, Any]:
    """Depth, ancestors, dependents; ``disk`` as ``GET /v1/snapshots`` gives it (logical: file sizes, physical:
    allocated blocks); ``own_bytes`` (blocks only this link holds: not its hard links into the image cache) and
    ``chain_bytes`` (own_bytes of this link and every ancestor: what forking it needs on disk)."""
    ancestors = registered_ancestors(registry, record)
    return {
        "depth": len(ancestors),
        "ancestors": [a.tag for a in ancestors],
        "dependents": registry.snapshot_children(record.tag),
        "all_dependents": descendants(registry, record.tag),
        "disk": directory_usage(record.path),
        "own_bytes": own_bytes(record.path),
        "chain_bytes": sum(own_bytes(r.path) for r in (record, *ancestors)),
    }


def own_bytes(directory: Path) -> int:
    """Bytes a snapshot's files really occupy (memory files are sparse); hard links to an image are not its own."""
    if not directory.is_dir():
        return 0
    total = 0
    for path in directory.iterdir():
        st = path.stat()
        if path.is_file() and st.st_nlink == 1:
            total += st.st_blocks * 512
    return total
