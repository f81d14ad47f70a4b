"""One ``Cluster.map``: items dispatched to node agents, retried when their node dies, delivered once.

Each attempt of an item has its own idempotency key (``<owner>.<run>.<index>.<attempt>``), so a fork
retried inside an attempt never makes a second child, while a new attempt on another node makes a
fresh one. An item's result is delivered the first time any attempt answers; an answer from an attempt
that was given up on (its node declared dead) is counted and dropped, never delivered twice.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorUnschedulableError, RayActorError, RayError, RayTaskError

from forkd.cluster.placement import Directory, PlacementError

POLL_S = 0.5  # how often a quiet map looks for dead nodes (Ray's health checks decide death)


class Placer(Protocol):
    """What a fan-out needs of the cluster (``Cluster`` is one): the directory, the agents, replication."""

    owner: str
    directory: Directory
    agents: dict[str, ActorHandle]

    def replicate_for(self, digest: str, n: int) -> list[dict[str, Any]]: ...

    def notice_deaths(self, wait_for: str | None = None) -> list[str]: ...

    def describe_nodes(self) -> str: ...


@dataclass(frozen=True)
class Outcome:
    """One item's answer: ``value`` (what fn returned) or ``error`` (what it raised), and where it ran."""

    index: int
    item: Any
    value: Any = None
    error: BaseException | None = None
    node_id: str = ""
    attempts: int = 1


@dataclass
class MapStats:
    """What a map went through: attempts per item, answers dropped as duplicates, children lost."""

    attempts: list[int] = field(default_factory=list)
    duplicates: int = 0
    lost_children: int = 0
    refused: int = 0
    dead_nodes: list[str] = field(default_factory=list)

    @property
    def retried(self) -> list[int]:
        return [index for index, count in enumerate(self.attempts) if count > 1]


@dataclass(frozen=True)
class _Attempt:
    index: int
    ray_node_id: str


class Fanout:
    """Iterate it for each item's ``Outcome`` as it lands (any order, each item exactly once)."""

    def __init__(self, cluster: Placer, digest: str, items: list[Any], fn: Callable[..., Any],
                 timeout_s: float | None, max_attempts: int) -> None:
        self.cluster, self.digest, self.items, self.fn = cluster, digest, items, fn
        self.timeout_s, self.max_attempts = timeout_s, max_attempts
        self.run_id = secrets.token_hex(4)
        self.stats = MapStats(attempts=[0] * len(items))
        self._pending: deque[int] = deque(range(len(items)))
        self._inflight: dict[ray.ObjectRef, _Attempt] = {}
        self._abandoned: dict[ray.ObjectRef, _Attempt] = {}
        self._done: set[int] = set()

    def __iter__(self) -> Iterator[Outcome]:
        cluster = self.cluster
        cluster.replicate_for(self.digest, len(self.items))  # replicate, then fan out
        try:
            while len(self._done) < len(self.items):
                self._dispatch()
                if not self._inflight and self._pending:
                    raise PlacementError(f"no alive node can take the {len(self._pending)} remaining item(s) of "
                                         f"snapshot {self.digest[:12]} ({cluster.describe_nodes()})")
                ready, _ = ray.wait([*self._inflight, *self._abandoned], num_returns=1, timeout=POLL_S)
                for ref in ready:
                    if (outcome := self._take(ref)) is not None:
                        yield outcome
                for ray_node_id in cluster.notice_deaths():
                    self._node_died(ray_node_id)
        finally:
            for ref in self._inflight:
                ray.cancel(ref)

    def _dispatch(self) -> None:
        """Start pending items on nodes with free slots (holders of the digest first); pull first when
        the holders are full and the items could run elsewhere."""
        cluster = self.cluster
        busy: dict[str, int] = {}
        for attempt in self._inflight.values():
            busy[attempt.ray_node_id] = busy.get(attempt.ray_node_id, 0) + 1
        while self._pending:
            free = [s for s in cluster.directory.holders(self.digest) if s.slots_free > busy.get(s.ray_node_id, 0)]
            if not free:
                if cluster.replicate_for(self.digest, len(self._pending) + len(self._inflight)):
                    continue
                return
            node = max(free, key=lambda s: s.slots_free - busy.get(s.ray_node_id, 0))
            index = self._pending.popleft()
            self.stats.attempts[index] += 1
            key = f"{cluster.owner}.{self.run_id}.{index}.{self.stats.attempts[index]}"
            ref = cluster.agents[node.ray_node_id].run.remote(self.digest, key, cluster.owner, self.fn,
                                                              self.items[index], self.timeout_s)
            self._inflight[ref] = _Attempt(index, node.ray_node_id)
            busy[node.ray_node_id] = busy.get(node.ray_node_id, 0) + 1

    def _take(self, ref: ray.ObjectRef) -> Outcome | None:
        attempt = self._inflight.pop(ref, None) or self._abandoned.pop(ref)
        index = attempt.index
        node_id = self.cluster.directory.nodes[attempt.ray_node_id].node_id
        try:
            answer = ray.get(ref)
        except (RayActorError, ActorUnschedulableError):  # the agent died (its node, or its process)
            if attempt.ray_node_id in self.cluster.notice_deaths(wait_for=attempt.ray_node_id):
                self._node_died(attempt.ray_node_id)
            self._retry(index, "its node agent died")
            return None
        except RayError as exc:  # fn raised: the item's own answer (as fn's exception when Ray can rebuild it)
            error = exc.as_instanceof_cause() if isinstance(exc, RayTaskError) else exc
            return self._deliver(Outcome(index, self.items[index], error=error, node_id=node_id,
                                         attempts=self.stats.attempts[index]))
        if "refused" in answer:  # the node is fuller than it said (other drivers): use only what it runs for us
            self.stats.refused += 1
            running = sum(1 for a in self._inflight.values() if a.ray_node_id == attempt.ray_node_id)
            self.cluster.directory.limit_slots(attempt.ray_node_id, running)
            self._retry(index, answer["refused"])
            return None
        return self._deliver(Outcome(index, self.items[index], value=answer["value"], node_id=node_id,
                                     attempts=self.stats.attempts[index]))

    def _deliver(self, outcome: Outcome) -> Outcome | None:
        if outcome.index in self._done:
            self.stats.duplicates += 1
            return None
        self._done.add(outcome.index)
        self._pending = deque(i for i in self._pending if i != outcome.index)
        return outcome

    def _retry(self, index: int, why: str) -> None:
        if index in self._done or index in self._pending or any(a.index == index for a in self._inflight.values()):
            return
        if self.stats.attempts[index] >= self.max_attempts:
            raise PlacementError(f"item {index} failed {self.stats.attempts[index]} attempts; the last: {why}")
        self._pending.appendleft(index)

    def _node_died(self, ray_node_id: str) -> None:
        """Give up on the node's attempts: their children are lost, their items go elsewhere."""
        if ray_node_id not in self.stats.dead_nodes:
            self.stats.dead_nodes.append(ray_node_id)
        for ref, attempt in list(self._inflight.items()):
            if attempt.ray_node_id == ray_node_id:
                del self._inflight[ref]
                self._abandoned[ref] = attempt
                self.stats.lost_children += 1
                self._retry(attempt.index, "its node died")

