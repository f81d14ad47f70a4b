"""The directory (which node holds which snapshot digest) and placement over it, without Ray.

A ``NodeState`` is one node's ``GET /v1/node`` answer plus where its daemon listens; the ``Directory``
is every node the cluster knows, alive or dead. Placement is pure arithmetic over it, so it is tested
without a cluster: a snapshot goes only to nodes whose restore-compatibility key equals a holder's;
holders are preferred, then free capacity; when the holders' free slots cannot take a fan-out, the
next best compatible nodes are named as replication targets, each with a holder to pull from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

DIGEST = re.compile(r"[0-9a-f]{64}")
# A node without a max_sandboxes limit answers slots_free null: its slots are then what its free memory
# holds at this much per child (a live child's private memory is ~45-60 MiB under TCG, docs/benchmarks.md).
CHILD_BYTES_ESTIMATE = 64 << 20


class PlacementError(LookupError):
    """The cluster cannot place what was asked; the message says which nodes hold what, and what to do."""


@dataclass(frozen=True)
class SnapshotCopy:
    """One snapshot as one node holds it: digests travel between nodes, tags stay node-local."""

    tag: str
    digest: str
    parent_digest: str | None = None
    bytes: int = 0
    status: str = "ready"


def _slots_free(capacity: dict[str, Any]) -> int:
    """Free slots as the node counts them, or, where it sets no limit (null), as its free memory allows."""
    slots = capacity.get("slots_free")
    if slots is None:
        slots = int(capacity.get("mem_available_bytes") or 0) // CHILD_BYTES_ESTIMATE
    return max(0, int(slots))


@dataclass(frozen=True)
class NodeState:
    """One forkd node: its Ray node, its daemon (URL and token) and what ``GET /v1/node`` said."""

    ray_node_id: str
    node_id: str
    url: str
    token: str | None
    compat_key: str
    compat: dict[str, Any]
    slots_free: int
    max_sandboxes: int  # 0: the node sets no limit
    live: int
    snapshots: tuple[SnapshotCopy, ...] = ()
    alive: bool = True
    e2b_url: str | None = None  # the node's E2B front, when it serves one (``forkd node start --e2b-url``)

    @classmethod
    def from_answers(cls, ray_node_id: str, url: str, token: str | None, node: dict[str, Any],
                     e2b_url: str | None = None) -> NodeState:
        """Built from the daemon's ``/v1/node`` answer (bounded: a node names at most what it holds)."""
        capacity = node.get("capacity", {})
        copies = tuple(SnapshotCopy(tag=str(s["tag"]), digest=str(s["digest"]), parent_digest=s.get("parent_digest"),
                                    bytes=int(s.get("bytes", 0)), status=str(s.get("status", "ready")))
                       for s in node.get("snapshots", []) if s.get("digest"))
        return cls(ray_node_id=ray_node_id, node_id=str(node["node_id"]), url=url, token=token,
                   compat_key=str(node["compat_key"]), compat=dict(node.get("compat", {})),
                   slots_free=_slots_free(capacity),
                   max_sandboxes=int(capacity.get("max_sandboxes") or 0), live=int(capacity.get("live", 0)),
                   snapshots=copies, e2b_url=e2b_url or None)

    def holds(self, digest: str) -> bool:
        return any(copy.digest == digest and copy.status == "ready" for copy in self.snapshots)

    def digest_of(self, tag: str) -> str | None:
        return next((copy.digest for copy in self.snapshots if copy.tag == tag), None)

    def tag_of(self, digest: str) -> str | None:
        return next((copy.tag for copy in self.snapshots if copy.digest == digest), None)

    @property
    def name(self) -> str:
        """How messages name the node: its forkd node id and the start of its Ray node id."""
        return f"{self.node_id} (ray {self.ray_node_id[:8]})"


@dataclass(frozen=True)
class Pull:
    """Replicate ``digest`` to ``target`` from ``source`` (a node that holds it)."""

    digest: str
    target: NodeState
    source: NodeState


@dataclass
class Directory:
    """Every node the cluster has seen, by Ray node id; dead ones stay, marked, so errors can name them."""

    nodes: dict[str, NodeState] = field(default_factory=dict)

    def update(self, states: Iterable[NodeState]) -> None:
        for state in states:
            self.nodes[state.ray_node_id] = state

    def mark_dead(self, ray_node_id: str) -> NodeState | None:
        state = self.nodes.get(ray_node_id)
        if state is not None and state.alive:
            self.nodes[ray_node_id] = replace(state, alive=False)
            return state
        return None

    @property
    def alive(self) -> list[NodeState]:
        return [state for state in self.nodes.values() if state.alive]

    def holders(self, digest: str) -> list[NodeState]:
        """Alive nodes holding ``digest``, the most free slots first."""
        return sorted((s for s in self.alive if s.holds(digest)), key=lambda s: (-s.slots_free, s.node_id))

    def resolve(self, snapshot: str) -> str:
        """The digest ``snapshot`` names: a digest held by an alive node, or a tag meaning one digest."""
        if DIGEST.fullmatch(snapshot):
            if self.holders(snapshot):
                return snapshot
            raise PlacementError(self._nobody_holds(snapshot))
        digests = {copy.digest for s in self.alive for copy in s.snapshots if copy.tag == snapshot}
        if len(digests) == 1:
            return digests.pop()
        if not digests:
            raise PlacementError(f"no alive node has a snapshot tagged {snapshot!r} (nodes: {self._names()}); "
                                 f"tags are node-local: name the snapshot by its digest (`forkd cluster status`)")
        raise PlacementError(f"tag {snapshot!r} means different snapshots on different nodes "
                             f"({', '.join(sorted(d[:12] for d in digests))}): name one by its digest")

    def _names(self) -> str:
        return ", ".join(s.name for s in self.alive) or "none alive"

    def _nobody_holds(self, digest: str) -> str:
        dead = [s.name for s in self.nodes.values() if not s.alive and s.holds(digest)]
        if dead:
            return (f"snapshot {digest[:12]} is held only by node(s) that died: {', '.join(dead)}; "
                    f"restart one of them or unpack the snapshot on an alive node")
        return (f"snapshot {digest[:12]} is held by none of the alive nodes ({self._names()}); "
                f"pull or unpack it on one of them first")

    def compatible(self, digest: str) -> list[NodeState]:
        """Alive nodes that may restore ``digest``: those whose compatibility key equals a holder's."""
        holders = self.holders(digest)
        if not holders:
            raise PlacementError(self._nobody_holds(digest))
        keys = {s.compat_key for s in holders}
        return [s for s in self.alive if s.compat_key in keys]

    def replication_plan(self, digest: str, n: int) -> list[Pull]:
        """Pulls that let ``n`` sandboxes of ``digest`` run at once: none when the holders have the slots,
        else the compatible non-holders with the most free slots until the slots suffice (or none are left).
        Each target pulls from a holder, spread over the holders."""
        holders = self.holders(digest)
        have = sum(s.slots_free for s in holders)
        if have >= n:
            return []
        candidates = sorted((s for s in self.compatible(digest) if not s.holds(digest) and s.slots_free > 0),
                            key=lambda s: (-s.slots_free, s.node_id))
        pulls: list[Pull] = []
        for target in candidates:
            if have >= n:
                break
            pulls.append(Pull(digest, target, holders[len(pulls) % len(holders)]))
            have += target.slots_free
        return pulls

    def limit_slots(self, ray_node_id: str, slots: int) -> None:
        """Record that a node has no more than ``slots`` free (it refused a fork) until the next refresh."""
        state = self.nodes[ray_node_id]
        self.nodes[ray_node_id] = replace(state, slots_free=min(state.slots_free, max(0, slots)))

    def with_copy(self, ray_node_id: str, copy: SnapshotCopy) -> None:
        """Record that a node now holds ``copy`` (after a pull) without asking it again."""
        state = self.nodes[ray_node_id]
        if not state.holds(copy.digest):
            self.nodes[ray_node_id] = replace(state, snapshots=(*state.snapshots, copy))

