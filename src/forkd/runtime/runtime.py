"""The runtime: one object owning the registry, the VMM backend, images, snapshots and sandboxes.

The daemon is a thin HTTP layer over this; nothing else starts VMs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from forkd.config import Paths
from forkd.image.builder import Image, ImageSpec, build_image, list_images, load_image, remove_image
from forkd.runtime.branches import BranchService, max_concurrent_from_env
from forkd.runtime.compact import CompactService
from forkd.runtime.registry import Registry, SnapshotRecord
from forkd.runtime.sandboxes import SandboxService
from forkd.runtime.snapshots import SnapshotRequest, SnapshotService
from forkd.store.files import DigestCache
from forkd.vmm.base import Vmm


class Runtime:
    def __init__(self, paths: Paths, vmm: Vmm) -> None:
        for directory in (paths.home, paths.snapshots, paths.sandboxes):
            directory.mkdir(parents=True, exist_ok=True)
        self.paths = paths
        self.vmm = vmm
        self.registry = Registry(paths.db)
        self.snapshots = SnapshotService(paths, self.registry, vmm, DigestCache())
        self.sandboxes = SandboxService(paths, self.registry, vmm, self.snapshots)
        self.compaction = CompactService(paths, self.registry, vmm, self.snapshots)
        self.branches = BranchService(paths, self.registry, vmm, self.snapshots, self.sandboxes,
                                      max_concurrent_from_env())
        self._image_lock = asyncio.Lock()

    def start(self) -> list[str]:
        """Reap whatever a previous daemon left behind; returns the sandbox ids reaped."""
        self.branches.reap_stale()
        return self.sandboxes.reap_stale()

    async def stop(self) -> None:
        await self.branches.wait_all()
        await asyncio.gather(self.sandboxes.kill_all(), self.snapshots.abort_all())
        self.registry.close()

    async def build_image(self, spec: ImageSpec, progress: Callable[[str], None], force: bool = False) -> Image:
        async with self._image_lock:  # two builds would race on the same cache directories
            return await asyncio.to_thread(build_image, spec, self.paths, progress, force)

    def images(self) -> list[Image]:
        return list_images(self.paths)

    def remove_image(self, name: str) -> None:
        remove_image(self.paths, name)

    async def create_snapshot(self, request: SnapshotRequest, progress: Callable[[str], None]) -> SnapshotRecord:
        image = load_image(self.paths, request.image)
        return await self.snapshots.create(request, image, progress)

    def remove_snapshot(self, tag: str, cascade: bool = False, force: bool = False) -> list[str]:
        return self.snapshots.remove(tag, self.sandboxes.count_of, cascade=cascade, force=force)
