"""What the E2B gateway knows of the cluster: the directory, placement of new sandboxes, and which
node runs which sandbox.

``Cluster`` is not thread-safe and its calls block (Ray, HTTP to the agents), so every call to it runs
on one thread of its own, away from the gateway's event loop; the loop reads a copy of the directory
published after each call (``NodeState`` is frozen). Ray's view of node deaths is read every half
second and the daemons' ``/v1/node`` every few seconds, so a dead node is known about as soon as Ray
declares it (docs/scale-out.md, "Ray's health checks").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from forkd.cluster.cluster import Cluster
from forkd.cluster.placement import NodeState, PlacementError

log = logging.getLogger("forkd.cluster.e2b")
T = TypeVar("T")

DEATHS_PERIOD_S = 0.5
REFRESH_PERIOD_S = 3.0
ROUTES_KEPT = 100_000  # sandbox -> node entries kept (the oldest go first; a miss asks the nodes again)


class Unplaceable(Exception):
    """A sandbox of a template cannot be placed: ``status`` is the HTTP answer, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ClusterView:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkd-e2b-directory")
        self.nodes: dict[str, NodeState] = dict(cluster.directory.nodes)  # by Ray node id; the loop's copy
        self.died_at: dict[str, float] = {}  # Ray node id -> when the gateway saw it dead (wall clock)
        self.routes: OrderedDict[str, str] = OrderedDict()  # sandbox id -> Ray node id
        self._watcher: asyncio.Task[None] | None = None

    # the directory thread

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._published, fn, *args)

    def _published(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        finally:
            now = time.time()
            for ray_node_id in self.cluster.deaths:
                self.died_at.setdefault(ray_node_id, now)
            self.nodes = dict(self.cluster.directory.nodes)

    def start(self) -> None:
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        last_refresh = time.monotonic()
        while True:
            await asyncio.sleep(DEATHS_PERIOD_S)
            try:
                if time.monotonic() - last_refresh >= REFRESH_PERIOD_S:
                    await self._call(self.cluster.refresh)
                    last_refresh = time.monotonic()
                else:
                    await self._call(self.cluster.notice_deaths)
            except Exception:  # a GCS hiccup must not end the gateway's view of the cluster
                log.exception("reading the cluster failed; trying again")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await asyncio.get_running_loop().run_in_executor(self._thread, self.cluster.close)
        self._thread.shutdown(wait=False)

    # placement

    async def place(self, template: str) -> list[tuple[NodeState, str]]:
        """Where to create a sandbox of ``template`` (a tag or digest): (node, the node's own tag for it),
        best first. Replicates first when no holder has a free slot; the first node's slot is reserved
        until the next refresh."""
        return await self._call(self._place, template)

    def _place(self, template: str) -> list[tuple[NodeState, str]]:
        cluster = self.cluster
        try:
            digest = cluster.resolve(template)
        except PlacementError as exc:
            raise Unplaceable(404, f"template {template!r} not found: {exc}") from None
        cluster.replicate_for(digest, 1)
        holders = [s for s in cluster.directory.holders(digest) if s.slots_free > 0 and s.e2b_url]
        if not holders:
            raise Unplaceable(503, f"every node that holds or can pull {template!r} is full or serves no E2B "
                                   f"front ({cluster.describe_nodes()}); try again later")
        best = holders[0]
        cluster.directory.limit_slots(best.ray_node_id, best.slots_free - 1)
        return [(s, s.tag_of(digest) or digest) for s in holders]

    async def free_slots(self, node: NodeState) -> int:
        """``node``'s free slots now (its ``/v1/node`` read again)."""
        def read() -> int:
            self.cluster.refresh()
            return self.cluster.directory.nodes[node.ray_node_id].slots_free
        return await self._call(read)

    async def spill(self, tag: str, home: NodeState, n: int) -> list[tuple[NodeState, str]]:
        """Places for ``n`` more sandboxes of ``tag`` (a snapshot ``home`` just made), one entry per
        sandbox, on other nodes, replicating it to them first; fewer when the cluster has no more room."""
        return await self._call(self._spill, tag, home, n)

    def _spill(self, tag: str, home: NodeState, n: int) -> list[tuple[NodeState, str]]:
        cluster = self.cluster
        cluster.refresh()
        digest = cluster.directory.nodes[home.ray_node_id].digest_of(tag)
        if digest is None:
            return []
        cluster.directory.limit_slots(home.ray_node_id, 0)  # home's share was forked there already
        cluster.replicate_for(digest, n)
        places: list[tuple[NodeState, str]] = []
        for node in cluster.directory.holders(digest):
            if node.e2b_url and node.ray_node_id != home.ray_node_id:
                take = min(n - len(places), node.slots_free)
                places += [(node, node.tag_of(digest) or digest)] * take
                cluster.directory.limit_slots(node.ray_node_id, node.slots_free - take)
        return places

    async def full(self, node: NodeState) -> None:
        """``node`` refused a sandbox (full, draining, unreachable): no more until the next refresh."""
        await self._call(self.cluster.directory.limit_slots, node.ray_node_id, 0)

    async def settle(self, node: NodeState) -> bool:
        """Whether ``node``, which did not answer, is dead (waits, bounded, for Ray to decide)."""
        await self._call(self.cluster.notice_deaths, node.ray_node_id)
        return not self.nodes[node.ray_node_id].alive

    # routes

    def remember(self, sandbox_id: str, node: NodeState) -> None:
        self.routes[sandbox_id] = node.ray_node_id
        self.routes.move_to_end(sandbox_id)
        while len(self.routes) > ROUTES_KEPT:
            self.routes.popitem(last=False)

    def forget(self, sandbox_id: str) -> None:
        self.routes.pop(sandbox_id, None)

    def route(self, sandbox_id: str) -> NodeState | None:
        ray_node_id = self.routes.get(sandbox_id)
        return self.nodes.get(ray_node_id) if ray_node_id else None

    @property
    def fronts(self) -> list[NodeState]:
        """Alive nodes serving an E2B front."""
        return [s for s in self.nodes.values() if s.alive and s.e2b_url]

    def lost(self, node: NodeState) -> str:
        """How a dead node's sandboxes are answered for."""
        when = self.died_at.get(node.ray_node_id)
        at = time.strftime(" at %H:%M:%S UTC", time.gmtime(when)) if when else ""
        return (f"it was lost with node {node.node_id}, which died{at}; create a new sandbox "
                f"(the cluster places it on an alive node)")

    def dead_names(self) -> list[str]:
        return [s.node_id for s in self.nodes.values() if not s.alive]
