"""Compaction: flatten a snapshot chain into one standalone snapshot (no parent, its own memory and disk).

A deep chain costs each spawn a little (one layer write per link) and pins every ancestor; a
compacted copy is an ordinary baked-style snapshot again: a full memory file (the base's data with
every layer laid over it, still sparse), a disk overlay directly over the root's base image, and the
same device state.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time

from forkd.config import Paths
from forkd.runtime.chains import ancestry
from forkd.runtime.registry import Registry, SnapshotRecord
from forkd.runtime.snapshots import (
    BASE_DISK_FILE,
    DISK_FILE,
    HASHED_FILES,
    INITRD_FILE,
    KERNEL_FILE,
    MEMORY_FILE,
    META_FILE,
    STATE_FILE,
    SnapshotConflict,
    SnapshotService,
    seal_files,
)
from forkd.store.files import link_or_copy, write_json_atomic
from forkd.store.layers import ChainMemory, flatten, punch_zero_pages
from forkd.validation import check_tag
from forkd.vmm.base import Vmm
from forkd.vmm.branching import branching_of


class CompactService:
    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, snapshots: SnapshotService) -> None:
        self.paths = paths
        self.registry = registry
        self.vmm = vmm
        self.snapshots = snapshots
        self._building: set[str] = set()

    async def compact(self, from_tag: str, to_tag: str) -> SnapshotRecord:
        to_tag = check_tag(to_tag)
        if self.registry.get_snapshot(to_tag) is not None or to_tag in self._building:
            raise SnapshotConflict(f"snapshot {to_tag!r} exists; pick another tag or remove it with `forkd rmi {to_tag}`")
        record, saved, _ = await asyncio.to_thread(self.snapshots.open, from_tag)  # verifies the whole chain
        root = ancestry(self.registry, record)[-1]
        self._building.add(to_tag)
        build_dir = self.paths.snapshots / f".build-{to_tag}-{secrets.token_hex(4)}"
        started = time.monotonic()
        try:
            build_dir.mkdir(parents=True)
            for source, name in ((record.path / KERNEL_FILE, KERNEL_FILE), (record.path / INITRD_FILE, INITRD_FILE),
                                 (root.path / BASE_DISK_FILE, BASE_DISK_FILE)):
                link_or_copy(source, build_dir / name)
            await asyncio.to_thread(flatten, ChainMemory(saved.memory, list(saved.layers)), build_dir / MEMORY_FILE)
            await asyncio.to_thread(punch_zero_pages, build_dir / MEMORY_FILE)
            shutil.copyfile(record.path / STATE_FILE, build_dir / STATE_FILE)
            shutil.copyfile(record.path / DISK_FILE, build_dir / DISK_FILE)
            os.chmod(build_dir / DISK_FILE, 0o600)
            await branching_of(self.vmm).flatten_disk(build_dir / DISK_FILE, BASE_DISK_FILE)
            meta = {k: v for k, v in record.meta.items()
                    if k in ("identity", "boot", "image_key", "warm_modules", "warmup_cmd")}
            meta.update({"memory_kind": "full", "compacted_from": record.tag,
                         "compacted_chain": [link.tag for link in ancestry(self.registry, record)]})
            meta["sha256"] = await asyncio.to_thread(seal_files, build_dir, HASHED_FILES)
            meta["sizes"] = {name: (build_dir / name).stat().st_size for name in HASHED_FILES}
            meta["compact_seconds"] = round(time.monotonic() - started, 3)
            write_json_atomic(build_dir / META_FILE, meta)
            compacted = SnapshotRecord(tag=to_tag, status="ready", image=record.image,
                                       path=self.paths.snapshots / to_tag, created_at=time.time(), meta=meta)
            self.snapshots.publish(build_dir, compacted, registered=False)
            return compacted
        finally:
            self._building.discard(to_tag)
            shutil.rmtree(build_dir, ignore_errors=True)
