"""Compaction: flatten a snapshot chain into one standalone snapshot (no parent, its own memory and disk).

A deep chain costs each spawn a little (one layer write per link) and pins every ancestor; a
compacted copy is an ordinary baked-style snapshot again: a full memory file (the base's data with
every layer laid over it, still sparse), a disk layer directly over the root's base image (flattened
by the VMM backend's disk format: any backend compacts, branching or not), and the same device state.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

from forkd.store.io import blocking, remove_tree
from forkd.store.layers import ChainMemory, flatten, punch_zero_pages
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
                                     (record.path / INITRD_FILE, INITRD_FILE),
                                     (chain[-1].path / BASE_DISK_FILE, BASE_DISK_FILE)):
                    await blocking(self.store.digests.link, source, build_dir / name)
                flat = await blocking(flatten, ChainMemory(saved.memory, list(saved.layers)), build_dir / MEMORY_FILE)
                await blocking(punch_zero_pages, build_dir / MEMORY_FILE)  # holes, not bytes: the digest holds
                disk = self.disk.file_name
                for name in (STATE_FILE, disk):
                    await blocking(shutil.copyfile, record.path / name, build_dir / name)
                os.chmod(build_dir / disk, 0o600)
                await self.disk.flatten(build_dir / disk, BASE_DISK_FILE)
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
