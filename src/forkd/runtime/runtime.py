"""The runtime: one object owning the registry, the VMM backend, images, snapshots and sandboxes.

The daemon is a thin HTTP layer over this; nothing else starts VMs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from forkd.config import Paths
from forkd.image.builder import (
    Image,
    ImageSpec,
    build_image,
    list_images,
    load_image,
    remove_image,
)
from forkd.packs.peer import PeerPuller
from forkd.packs.service import PackService
from forkd.packs.space import SpaceFloor
from forkd.packs.transfer import UrlPolicy
from forkd.runtime.branches import BranchService
from forkd.runtime.compact import CompactService
from forkd.runtime.driver_forks import DriverForks
from forkd.runtime.isolation import Isolation
from forkd.runtime.metrics import Metrics
from forkd.runtime.node import NodeService
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.recovery import Recovery, recover
from forkd.store.registry import Registry, SnapshotRecord
from forkd.runtime.sandboxes import SandboxService
from forkd.runtime.sessions import Sessions
from forkd.runtime.snapshots import SnapshotRequest, SnapshotService
from forkd.runtime.workspaces import WorkspaceService
from forkd.store.files import DigestCache
from forkd.store.io import blocking
from forkd.store.snapshots import Claim, SnapshotStore
from forkd.vmm.base import Vmm


class Runtime:
    def __init__(self, paths: Paths, vmm: Vmm, options: RuntimeOptions | None = None) -> None:
        for directory in (paths.home, paths.snapshots, paths.sandboxes, paths.uploads):
            directory.mkdir(parents=True, exist_ok=True)
        self.paths = paths
        self.vmm = vmm
        self.registry = Registry(paths.db)
        self.store = SnapshotStore(paths.snapshots, self.registry, DigestCache(), vmm.identity, vmm.disk)
        self.snapshots = SnapshotService(paths, self.store, vmm)
        self.options = options or RuntimeOptions()
        self.metrics = Metrics()
        self.sandboxes = SandboxService(paths, self.registry, vmm, self.snapshots, self.metrics,
                                        Isolation.from_options(self.registry, self.options), self.options)
        if self.options.host_roots is not None:
            self.options.host_roots.create()
        roots = self.options.host_roots
        self.packs = PackService(self.store, self.sandboxes.count_of, roots, UrlPolicy(self.options.transfer_hosts),
                                 SpaceFloor(self.options.pack_free_floor_bytes, roots.packs if roots else None),
                                 self.options.allow_unpinned_pulls)
        self.peers = PeerPuller(self.packs)
        self.node = NodeService(paths.home, vmm, self.store, self.sandboxes, self.options)
        self.driver_forks = DriverForks(self.registry, self.sandboxes)
        self.metrics.watch_states(lambda: (s.record.status for s in self.sandboxes.live()),
                                  lambda: (s.status for s in self.registry.list_snapshots()))
        self.metrics.watch_pools(self.sandboxes.pool.list)
        self.compaction = CompactService(self.store, vmm.disk)
        self.branches = BranchService(paths, self.store, vmm, self.sandboxes, self.options.max_concurrent_branches,
                                      self.metrics)
        self.sessions = Sessions(self.sandboxes, self.options.output, paths.uploads)
        self.workspaces = WorkspaceService(self.registry, self.sandboxes, self.branches, self.remove_snapshot)
        self._image_lock = asyncio.Lock()
        self._keepers: list[asyncio.Task[None]] = []

    async def start(self) -> Recovery:
        """Re-adopt the sandboxes a previous daemon left running, reap the rest, half-built snapshots and
        branches, then start enforcing sandbox timeouts (a re-adopted sandbox keeps its deadline) and
        console bounds."""
        await asyncio.to_thread(self.vmm.capabilities)  # the backend may run its binary once (version, machine)
        recovery = await recover(self.sandboxes, self.store)
        await asyncio.to_thread(self.packs.remove_partials)
        self.sandboxes.pool.start()
        loop = asyncio.get_running_loop()
        self._keepers = [loop.create_task(self.sandboxes.expire_forever()),
                         loop.create_task(self.sandboxes.bound_logs_forever())]
        return recovery

    async def stop(self) -> None:
        """Finish branches being written, then kill every sandbox (or leave them for the next daemon when
        ``keep_sandboxes_on_stop``)."""
        for keeper in self._keepers:
            keeper.cancel()
        await self.branches.wait_all()
        await self.sandboxes.pool.stop()  # idle members are never left for the next daemon
        leave = self.sandboxes.detach_all() if self.options.keep_sandboxes_on_stop else self.sandboxes.kill_all()
        await asyncio.gather(leave, self.snapshots.abort_all())
        self.registry.close()

    def confine_image_sources(self, spec: ImageSpec) -> ImageSpec:
        """``spec`` with its root tree or OCI tarball confined to the imports directory (when the daemon has one)."""
        roots = self.options.host_roots
        if roots is None:
            return spec
        return dataclasses.replace(
            spec,
            source_dir=spec.source_dir and roots.import_source(spec.source_dir, "source directory"),
            source_oci=spec.source_oci and roots.import_source(spec.source_oci, "OCI tarball"))

    async def build_image(self, spec: ImageSpec, progress: Callable[[str], None], force: bool = False) -> Image:
        spec = self.confine_image_sources(spec)
        async with self._image_lock:  # two builds would race on the same cache directories
            return await asyncio.to_thread(build_image, spec, self.paths, progress, force)

    def images(self) -> list[Image]:
        return list_images(self.paths)

    async def remove_image(self, name: str) -> None:
        # Off the loop: it waits for the image's lock (a build holds it for minutes) and removes gigabytes.
        await blocking(remove_image, self.paths, name)

    async def create_snapshot(self, request: SnapshotRequest, progress: Callable[[str], None],
                              claim: Claim | None = None) -> SnapshotRecord:
        """Create a snapshot; ``claim`` when the caller already holds the tag (``snapshots.claim``)."""
        try:
            image = load_image(self.paths, request.image)
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        return await self.snapshots.create(request, image, progress, claim=claim)

    async def remove_snapshot(self, tag: str, cascade: bool = False, force: bool = False) -> list[str]:
        """Remove snapshots (refused while children of them start or run) and kill their pools' members."""
        removed = await self.store.remove(tag, self.sandboxes.count_of, cascade=cascade, force=force)
        for gone in removed:
            await self.sandboxes.pool.discard(gone)
        return removed
