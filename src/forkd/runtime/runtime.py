"""The runtime: one object owning the registry, the VMM backend, images, snapshots and sandboxes.

The daemon is a thin HTTP layer over this; nothing else starts VMs. ``await Runtime.open(...)``
makes the state directories and opens ``state.db``; the constructor only wires the services
together (no I/O), and ``start()`` recovers what a previous daemon left and starts the keepers.

The fronts (daemon routes, the E2B front, MCP through the daemon) use only its services and the
few methods below (``FRONT_SURFACE``), never the registry, the store, the VMM or the pool's owner:
tests/unit/test_architecture.py checks it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

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
from forkd.store.space import SpaceFloor
from forkd.packs.transfer import UrlPolicy
from forkd.runtime.branches import BranchService
from forkd.runtime.compact import CompactService
from forkd.runtime.drain import DrainService
from forkd.runtime.driver_forks import DriverForks
from forkd.runtime.isolation import Isolation
from forkd.runtime.keepers import console_keeper, deadline_keeper, idle_keeper
from forkd.runtime.metrics import Metrics
from forkd.runtime.node import NodeService
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.pool import PoolService
from forkd.runtime.recovery import Recovery, recover
from forkd.runtime.sandboxes import SandboxService
from forkd.runtime.sessions import Sessions
from forkd.runtime.snapshots import SnapshotRequest, SnapshotService
from forkd.runtime.spawning import Spawner
from forkd.runtime.spool import SpoolBudget
from forkd.runtime.tunnels import Tunnels
from forkd.runtime.workspaces import WorkspaceService
from forkd.store.chains import describe_chain
from forkd.store.files import DigestCache
from forkd.store.io import blocking, long_job
from forkd.store.registry import Registry, SnapshotRecord
from forkd.store.snapshots import Claim, SnapshotStore
from forkd.validation import new_sandbox_id
from forkd.vmm.base import Capabilities, Vmm, VmHandle

# What a front may use of a Runtime: its services and the methods that answer for the store and the VMM.
FRONT_SURFACE = frozenset({
    "sandboxes", "spawner", "pools", "sessions", "tunnels", "branches", "workspaces", "packs", "snapshots", "compaction",
    "peers", "node", "drain", "driver_forks", "metrics", "paths", "start", "stop", "images", "build_image",
    "remove_image", "confine_image_sources", "create_snapshot", "remove_snapshot", "snapshot", "snapshot_by_digest",
    "snapshot_records", "snapshot_listing", "describe_snapshot", "capabilities", "space"})


class Runtime:
    def __init__(self, paths: Paths, vmm: Vmm, registry: Registry, isolation: Isolation,
                 options: RuntimeOptions | None = None) -> None:
        """Wire the services over an open ``registry`` (``Runtime.open`` makes one); no I/O here."""
        self.paths = paths
        self.vmm = vmm
        self.registry = registry
        self.options = options or RuntimeOptions()
        self.store = SnapshotStore(paths.snapshots, registry, DigestCache(), vmm.identity, vmm.disk)
        roots = self.options.host_roots
        self.space = space = SpaceFloor(self.options.free_floor_bytes, roots.packs if roots else None)
        self.snapshots = SnapshotService(paths, self.store, vmm, space, self.options.default_machine)
        self.metrics = Metrics()
        self.sandboxes = SandboxService(paths, registry, vmm, isolation, self.options.idle_stop_s,
                                        self.options.idle_reclaim)
        self.pools = PoolService(paths, registry, vmm, self.store, isolation, self.sandboxes.release, new_sandbox_id,
                                 self.options.pool_sizes, warm=self.options.warm_pools)
        self.spawner = Spawner(paths, registry, vmm, self.store, self.sandboxes, self.pools, isolation, self.metrics,
                               space, self.options)
        self.packs = PackService(self.store, self.spawner.count_of, roots, UrlPolicy(self.options.transfer_hosts), space,
                                 self.options.allow_unpinned_pulls, replacing=self.pools.replacing)
        self.peers = PeerPuller(self.packs)
        self.drain = DrainService(self.spawner, self.pools, self.sandboxes, paths.home)
        self.node = NodeService(paths.home, vmm, self.store, self.sandboxes, self.options, self.drain)
        self.driver_forks = DriverForks(self.registry, self.sandboxes, self.spawner)
        self.metrics.watch_states(lambda: (s.record.status for s in self.sandboxes.live()),
                                  lambda: (s.status for s in self.registry.list_snapshots()))
        self.metrics.watch_pools(self.pools.list)
        self.metrics.watch_idle(self.sandboxes.idle.stopped, self.sandboxes.idle.reclaim)
        self.compaction = CompactService(self.store, vmm.disk)
        self.branches = BranchService(paths, self.store, vmm, self.sandboxes, self.spawner,
                                      self.options.max_concurrent_branches, self.metrics, space, self.compaction,
                                      self.options.max_chain_depth)
        self.sessions = Sessions(self.sandboxes, self.options.output, paths.uploads, space,
                                 SpoolBudget(self.options.spool_bytes, self.options.spool_files))
        self.tunnels = Tunnels(self.sandboxes)
        self.workspaces = WorkspaceService(self.registry, self.sandboxes, self.spawner, self.branches,
                                           self.remove_snapshot)
        self._image_lock = asyncio.Lock()
        self._keepers: list[asyncio.Task[None]] = []

    @classmethod
    async def open(cls, paths: Paths, vmm: Vmm, options: RuntimeOptions | None = None) -> Runtime:
        """The runtime over ``paths``: its directories made, ``state.db`` opened (and migrated), the host's
        network and cgroup setup read. Nothing is started: that is ``start()``."""
        options = options or RuntimeOptions()

        def state() -> tuple[Registry, Isolation]:
            for directory in (paths.home, paths.snapshots, paths.sandboxes, paths.uploads):
                directory.mkdir(parents=True, exist_ok=True)
            if options.host_roots is not None:
                options.host_roots.create()
            registry = Registry(paths.db)
            try:
                return registry, Isolation.from_options(registry, options)
            except BaseException:
                registry.close()
                raise

        registry, isolation = await asyncio.to_thread(state)
        return cls(paths, vmm, registry, isolation, options)

    async def start(self) -> Recovery:
        """Re-adopt the sandboxes a previous daemon left running, reap the rest, half-built snapshots and
        branches, then start enforcing sandbox timeouts (a re-adopted sandbox keeps its deadline) and
        console bounds."""
        # The backend's one-time work (runs its binary, measures the host, checks its jail) off the loop.
        await asyncio.to_thread(self.vmm.capabilities)
        recovery = await recover(self.sandboxes, self.store)
        for sandbox_id, tag in recovery.resumed.items():
            await self.branches.refuse(sandbox_id, f"the daemon stopped while branching it to {tag!r}, so its "
                                       "disk may hold a layer no snapshot received; fork a new sandbox to branch from")
        await asyncio.to_thread(self.packs.remove_partials)
        await self.drain.restore()  # before the pools start filling
        await self.pools.start()
        loop = asyncio.get_running_loop()
        self._keepers = [loop.create_task(deadline_keeper(self.sandboxes)),
                         loop.create_task(console_keeper(self.consoles)),
                         loop.create_task(idle_keeper(self.sandboxes.idle))]
        return recovery

    async def stop(self) -> None:
        """End forks in flight (every VMM they started is killed), finish branches being written, then kill
        every sandbox (or leave the live ones for the next daemon when ``keep_sandboxes_on_stop``)."""
        for keeper in self._keepers:
            keeper.cancel()
        await self.spawner.stop()  # before the pools stop: a member a cancelled child took goes back to be killed
        await self.branches.wait_all()
        await self.pools.stop()  # idle members are never left for the next daemon
        leave = self.sandboxes.detach_all() if self.options.keep_sandboxes_on_stop else self.sandboxes.kill_all()
        await asyncio.gather(leave, self.snapshots.abort_all())
        self.registry.close()

    def consoles(self) -> list[VmHandle]:
        """Every VMM whose guest writes a console the host keeps: live sandboxes and parents being baked."""
        return [*(s.vm for s in self.sandboxes.live()), *self.snapshots.parents()]

    def capabilities(self) -> Capabilities:
        """What the VMM backend and the host offer (``GET /v1/system``)."""
        return self.vmm.capabilities()

    def snapshot(self, tag: str) -> SnapshotRecord | None:
        return self.registry.get_snapshot(tag)

    async def snapshot_by_digest(self, digest: str) -> SnapshotRecord:
        """The snapshot with content digest ``digest`` on this node (DigestNotFound if none); off the loop."""
        return await asyncio.to_thread(self.store.get_digest, digest)

    def snapshot_records(self) -> list[SnapshotRecord]:
        return self.registry.list_snapshots()

    async def snapshot_listing(self) -> list[dict[str, Any]]:
        """Every snapshot with its disk usage (a walk of the store, on its own threads)."""
        return await self.store.listing()

    def describe_snapshot(self, tag: str) -> dict[str, Any]:
        """One snapshot with its chain: depth, ancestors, dependents, sizes."""
        record = self.registry.get_snapshot(tag)
        if record is None:
            raise LookupError(f"no snapshot {tag!r}; list them with `forkd snapshots`")
        return {**record.to_dict(), **describe_chain(self.registry, record)}

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
            return await long_job(build_image, spec, self.paths, progress, force)

    def images(self) -> list[Image]:
        return list_images(self.paths)

    async def remove_image(self, name: str) -> None:
        # Off the loop: it removes gigabytes. A build holding the image's lock makes it a 409 (ImageBusy)
        # at once: it never waits for the lock on a thread.
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
        removed = await self.store.remove(tag, self.spawner.count_of, cascade=cascade, force=force)
        for gone in removed:
            await self.pools.discard(gone)
        return removed
