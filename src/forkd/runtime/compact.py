"""Compaction: flatten a snapshot chain into one standalone snapshot (no parent, its own memory and disk).

A deep chain costs each spawn a little (one layer write per link) and pins every ancestor; a
compacted copy is an ordinary baked-style snapshot again: a full memory file (the base's data with
every layer laid over it, still sparse), a disk layer directly over the root's base image (flattened
by the VMM backend's disk format: any backend compacts, branching or not), and the same device state.

The same flattening bounds every chain as it grows: a BRANCH whose parent already has
``max_chain_depth`` ancestors is written standalone (:meth:`CompactService.flatten_into`, called by
runtime/branches.py), so no path that adds a layer (REST BRANCH, snapshot-diff, a workspace's
suspend, E2B's pause, snapshot and fork) makes a chain deeper than the bound.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

from forkd.store.io import blocking, remove_tree
from forkd.store.layers import ChainMemory, Flattened, flatten, punch_zero_pages
from forkd.store.layout import (
    BASE_DISK_FILE,
    INHERITED_META,
    INITRD_FILE,
    KERNEL_FILE,
    MEMORY_FILE,
    STATE_FILE,
    baked_files,
)
from forkd.store.registry import SnapshotRecord
from forkd.store.snapshots import SnapshotStore
from forkd.vmm.base import Pages
from forkd.vmm.disk import DiskFormat


class CompactService:
    def __init__(self, store: SnapshotStore, disk: DiskFormat) -> None:
        self.store = store
        self.disk = disk

    async def compact(self, from_tag: str, to_tag: str) -> SnapshotRecord:
        with self.store.claim(to_tag, "compacted") as claim:
            record, saved, _ = await asyncio.to_thread(self.store.open, from_tag)  # verifies the whole chain
            chain = self.store.ancestry(record)
            build_dir = self.store.build_dir(claim.tags[0])
            started = time.monotonic()
            try:
                for source, name in ((record.path / KERNEL_FILE, KERNEL_FILE),
                                     (record.path / INITRD_FILE, INITRD_FILE)):
                    await blocking(self.store.digests.link, source, build_dir / name)
                disk = self.disk.file_name
                for name in (STATE_FILE, disk):
                    await blocking(shutil.copyfile, record.path / name, build_dir / name)
                flat = await self.flatten_into(build_dir, chain, ChainMemory(saved.memory, list(saved.layers)))
                files = baked_files(disk)
                # state_format: the top's device state file is the one copied, and restored as written.
                meta = {k: v for k, v in record.meta.items() if k in (*INHERITED_META, "state_format")}
                meta.update({"memory_kind": "full", "compacted_from": record.tag,
                             "compacted_chain": [link.tag for link in chain]})
                meta["sha256"] = await blocking(self.store.seal, build_dir, files, {MEMORY_FILE: flat.sha256})
                meta["sizes"] = {name: (build_dir / name).stat().st_size for name in files}
                meta["compact_seconds"] = round(time.monotonic() - started, 3)
                compacted = SnapshotRecord(tag=claim.tags[0], status="ready", image=record.image,
                                           path=self.store.directory / claim.tags[0], created_at=time.time(),
                                           meta=self.store.write_meta(build_dir, meta))
                await blocking(self.store.publish, claim, [(build_dir, compacted)])
                return compacted
            finally:
                await remove_tree(build_dir)

    async def flatten_into(self, build_dir: Path, chain: list[SnapshotRecord], memory: ChainMemory,
                           top: Pages | None = None) -> Flattened:
        """Make ``build_dir``'s disk layer (lying over ``chain[0]``'s) standalone over the chain root's base
        image, and write its whole memory (``memory`` with ``top`` laid over it) as one sparse file.

        Blocking work runs on threads; nothing outside ``build_dir`` is written, so a crash leaves only a
        build directory the store removes."""
        await blocking(self.store.digests.link, chain[-1].path / BASE_DISK_FILE, build_dir / BASE_DISK_FILE)
        flat = await blocking(flatten, memory, build_dir / MEMORY_FILE, top)
        await blocking(punch_zero_pages, build_dir / MEMORY_FILE)  # holes, not bytes: the digest holds
        disk = build_dir / self.disk.file_name
        os.chmod(disk, 0o600)
        await self.disk.flatten(disk, BASE_DISK_FILE)
        return flat
