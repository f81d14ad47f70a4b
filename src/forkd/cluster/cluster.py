"""``Cluster``: forkd across the nodes of a Ray cluster, through one agent actor per node.

A forkd node is a Ray node with the ``forkd`` resource whose workers find their daemon in
``FORKD_URL``/``FORKD_TOKEN`` (``forkd node start`` sets both). Ray keeps the membership, notices
dead nodes (its health checks), and restarts agents; the cluster keeps the directory of which node
holds which snapshot digest and places work by it. Every child the cluster makes carries the owner
label ``ray-job-<driver's job id>``, so the children of a driver that died are reaped on every node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from forkd.cluster.actor import NodeAgent, owner_of
from forkd.cluster.fanout import Fanout, Outcome
from forkd.cluster.placement import Directory, NodeState, PlacementError, Pull, SnapshotCopy
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.errors import ForkdError
from forkd.sdk.sandbox_sync import Sandbox

log = logging.getLogger("forkd.cluster")

RESOURCE = "forkd"  # the custom resource that marks a Ray node as a forkd node
NAMESPACE = "forkd"  # agents are named detached actors here, shared by every driver
AGENT_CONCURRENCY = 256  # calls one agent serves at once (each mostly waits on its daemon)
CALL_TIMEOUT_S = 60.0  # a describe or a fork answers well within this
PULL_TIMEOUT_S = 3600.0
DEATH_WAIT_S = 30.0  # how long an agent failure waits for Ray to say whether its node died


class Cluster:
    """Places forks across the forkd nodes of the Ray cluster at ``address`` (default: the one this
    process is in, else ``RAY_ADDRESS``, else one running on this host; never a new one)."""

    def __init__(self, address: str | None = None, *, item_timeout_s: float | None = 600.0,
                 max_attempts: int = 4) -> None:
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=NAMESPACE,
                     logging_level=logging.WARNING)
        self.owner = owner_of(ray.get_runtime_context().get_job_id())
        self.item_timeout_s, self.max_attempts = item_timeout_s, max_attempts
        self.directory = Directory()
        self.agents: dict[str, ActorHandle] = {}
        self.deaths: dict[str, float] = {}  # Ray node id -> when this driver saw it dead (monotonic)
        self.pulls: list[dict[str, Any]] = []  # every replication: target, source, digest, the target's answer
        self.failed_pulls: set[tuple[str, str]] = set()  # (Ray node id, digest) pulls that failed: not asked again
        self.refresh()

    # the directory

    def refresh(self) -> Directory:
        """Ask Ray which forkd nodes are alive and every alive node's agent what its daemon holds."""
        alive = set(self._alive_forkd_nodes())
        self.notice_deaths()
        for ray_node_id in alive - set(self.agents):
            self.agents[ray_node_id] = self._agent(ray_node_id)
        refs = {ray_node_id: self.agents[ray_node_id].describe.remote() for ray_node_id in alive}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        for ray_node_id, ref in refs.items():
            if ref not in ready:
                log.warning("forkd node agent on Ray node %s did not answer; left out for now", ray_node_id)
                continue
            try:
                answer = ray.get(ref)
                state = NodeState.from_answers(ray_node_id, answer["url"], answer["token"], answer["node"],
                                               answer.get("e2b_url"))
            except ray.exceptions.RayError as exc:
                log.warning("forkd node agent on Ray node %s failed: %s", ray_node_id, exc)
                continue
            except (KeyError, TypeError, ValueError) as exc:  # a daemon answering what the node API does not say
                log.warning("forkd node on Ray node %s answered a malformed /v1/node (%r); left out", ray_node_id, exc)
                continue
            self.directory.update([state])
        return self.directory

    def _alive_forkd_nodes(self) -> list[str]:
        return [node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get(RESOURCE)]

    def _agent(self, ray_node_id: str) -> ActorHandle:
        return ray.remote(NodeAgent).options(  # type: ignore[no-any-return]
            name=f"forkd-node-{ray_node_id}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=AGENT_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False)).remote()

    def notice_deaths(self, wait_for: str | None = None) -> list[str]:
        """Nodes Ray now reports dead that the directory still had alive (marked dead here). With
        ``wait_for``, wait (bounded) until Ray decides on that node: alive with a restarted agent, or dead."""
        deadline = time.monotonic() + (DEATH_WAIT_S if wait_for else 0.0)
        while True:
            states = {node["NodeID"]: node["Alive"] for node in ray.nodes()}
            died = [n for n, state in self.directory.nodes.items() if state.alive and not states.get(n, False)]
            for ray_node_id in died:
                self.directory.mark_dead(ray_node_id)
                self.deaths[ray_node_id] = time.monotonic()
                self.agents.pop(ray_node_id, None)
                log.warning("forkd node on Ray node %s is dead; its children are lost", ray_node_id)
            settled = wait_for is None or not self.directory.nodes[wait_for].alive or self._agent_answers(wait_for)
            if died or settled or time.monotonic() >= deadline:
                return died
            time.sleep(0.2)

    def _agent_answers(self, ray_node_id: str) -> bool:
        agent = self.agents.get(ray_node_id)
        if agent is None:
            return False
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(agent.pid.remote(), timeout=1.0)
            return True
        return False

    def describe_nodes(self) -> str:
        return "; ".join(f"{s.name}: {'alive' if s.alive else 'dead'}, {s.slots_free} slots free, "
                         f"{len(s.snapshots)} snapshots" for s in self.directory.nodes.values()) or "no forkd nodes"

    def resolve(self, snapshot: str) -> str:
        """The digest a tag or digest names across the cluster (see ``Directory.resolve``)."""
        try:
            return self.directory.resolve(snapshot)
        except PlacementError:
            self.refresh()
            return self.directory.resolve(snapshot)

    # replication

    def replicate_for(self, digest: str, n: int) -> list[dict[str, Any]]:
        """Replicate ``digest`` (in parallel) to as many of the next best nodes as ``n`` sandboxes need
        (a node whose pull of it failed before is not asked again by this driver)."""
        plan = self.directory.replication_plan(digest, n)
        return self._run_pulls([p for p in plan if (p.target.ray_node_id, digest) not in self.failed_pulls])

    def replicate(self, snapshot: str, to: int) -> list[dict[str, Any]]:
        """Make ``to`` alive compatible nodes hold ``snapshot`` (a tag or digest); answers the pulls made."""
        digest = self.resolve(snapshot)
        holders = self.directory.holders(digest)
        candidates = sorted((s for s in self.directory.compatible(digest) if not s.holds(digest)),
                            key=lambda s: (-s.slots_free, s.node_id))
        if to > len(holders) + len(candidates):
            raise PlacementError(f"only {len(holders) + len(candidates)} alive node(s) can hold snapshot "
                                 f"{digest[:12]} (compatible with its holders {', '.join(s.name for s in holders)}); "
                                 f"asked for {to}")
        plan = [Pull(digest, target, holders[i % len(holders)])
                for i, target in enumerate(candidates[:max(0, to - len(holders))])]
        done = self._run_pulls(plan)
        if len(done) < len(plan):
            failed = {p.target.node_id for p in plan} - {record["target"] for record in done}
            raise PlacementError(f"{', '.join(sorted(failed))} could not pull {digest[:12]} (their errors are in "
                                 f"this driver's log); {len(done)} other node(s) did")
        return done

    def _run_pulls(self, plan: list[Pull]) -> list[dict[str, Any]]:
        if not plan:
            return []
        refs = {self.agents[p.target.ray_node_id].pull.remote(p.digest, p.source.url, p.source.token): p
                for p in plan}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PULL_TIMEOUT_S)
        done = []
        for ref, pull in refs.items():
            try:
                answer = ray.get(ref, timeout=0) if ref in ready else None
            except ray.exceptions.RayError as exc:
                log.warning("node %s could not pull %s from %s: %s", pull.target.name, pull.digest[:12],
                            pull.source.name, exc)
                answer = None
            if answer is None:
                log.warning("node %s did not pull %s (within %.0f s); not asked again", pull.target.name,
                            pull.digest[:12], PULL_TIMEOUT_S)
                self.failed_pulls.add((pull.target.ray_node_id, pull.digest))
                continue
            self.directory.with_copy(pull.target.ray_node_id, SnapshotCopy(tag=answer["tag"], digest=answer["digest"]))
            record = {"target": pull.target.node_id, "source": pull.source.node_id, "digest": pull.digest, **answer}
            self.pulls.append(record)
            done.append(record)
        return done

    # work

    def map_iter(self, snapshot: str, items: Iterable[Any], fn: Callable[[Sandbox, Any], Any]) -> Fanout:
        """Like ``map``, but an iterable of ``Outcome`` as items finish (its ``stats`` say what happened)."""
        self.refresh()
        return Fanout(self, self.resolve(snapshot), list(items), fn, self.item_timeout_s, self.max_attempts)

    def map(self, snapshot: str, items: Iterable[Any], fn: Callable[[Sandbox, Any], Any]) -> list[Any]:
        """``fn(sandbox, item)`` for every item, each in a fresh sandbox of ``snapshot`` on some node;
        the values in the items' order. An item whose node dies runs again elsewhere; each is answered
        once. The first error ``fn`` raised is raised after every item finished."""
        outcomes: dict[int, Outcome] = {o.index: o for o in self.map_iter(snapshot, items, fn)}
        for index in sorted(outcomes):
            if (error := outcomes[index].error) is not None:
                raise error
        return [outcomes[index].value for index in sorted(outcomes)]

    def create(self, template: str, timeout_s: float | None = 300.0) -> Sandbox:
        """One sandbox of ``template`` (tag or digest) on the best node: the SDK's own ``Sandbox``, bound to it."""
        self.refresh()  # the free slots now, not at the last map
        digest = self.resolve(template)
        self.replicate_for(digest, 1)
        return self._fork_shares(digest, [(self.best(digest), 1)], timeout_s)[0]

    def fork(self, sandbox: Sandbox, n: int, timeout_s: float | None = 300.0) -> list[Sandbox]:
        """``n`` forks of a running sandbox: BRANCH it on its node, fork the branch there, and spill to
        other nodes (replicating the branch to them) when its node has fewer free slots than ``n``."""
        self.refresh()
        home = self._node_of(sandbox)
        room = sum(s.slots_free for s in self.directory.alive if s.compat_key == home.compat_key)
        if room < n:  # refused before a BRANCH is made for nothing
            raise PlacementError(f"no room for {n - room} of {n} forks of {sandbox.sandbox_id}: the nodes that can "
                                 f"restore it have {room} free slots ({self.describe_nodes()})")
        tag = sandbox.api.branch(sandbox.sandbox_id)["tag"]
        self.refresh()
        home = self.directory.nodes[home.ray_node_id]
        digest = next((c.digest for c in home.snapshots if c.tag == tag), None)
        if digest is None:
            raise PlacementError(f"the branch {tag!r} of {sandbox.sandbox_id} is not listed by {home.name}")
        self.replicate_for(digest, n)
        shares: list[tuple[NodeState, int]] = []
        left = n
        for node in sorted(self.directory.holders(digest), key=lambda s: s.ray_node_id != home.ray_node_id):
            if left and (take := min(left, node.slots_free)):
                shares.append((node, take))
                left -= take
        if left:
            raise PlacementError(f"no room for {left} of {n} forks of {sandbox.sandbox_id} ({self.describe_nodes()})")
        return self._fork_shares(digest, shares, timeout_s)

    def best(self, digest: str) -> NodeState:
        """The holder of ``digest`` to fork it on next: the one with the most free slots."""
        holders = [s for s in self.directory.holders(digest) if s.slots_free > 0]
        if not holders:
            raise PlacementError(f"every node holding {digest[:12]} is full ({self.describe_nodes()})")
        return holders[0]

    def _fork_shares(self, digest: str, shares: list[tuple[NodeState, int]], timeout_s: float | None) -> list[Sandbox]:
        """Fork each node's share in parallel; all of them or none (the started ones are killed)."""
        refs = [(node, self.agents[node.ray_node_id].fork.remote(digest, count, f"{self.owner}.{secrets.token_hex(8)}",
                                                                  self.owner, timeout_s), count)
                for node, count in shares]
        children: list[Sandbox] = []
        failures: list[str] = []
        for node, ref, count in refs:
            try:
                ids = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except ray.exceptions.RayError as exc:  # its last line is the agent's own error
                failures.append(f"{node.name}: {(str(exc).strip().splitlines() or [type(exc).__name__])[-1]}")
                continue
            connection = ConnectionConfig(url=node.url, token=node.token)
            children += [Sandbox.connect(sandbox_id, connection=connection) for sandbox_id in ids]
            if len(ids) < count:
                failures.append(f"{node.name}: {count - len(ids)} of {count} children did not start")
        if failures:
            for child in children:
                with contextlib.suppress(ForkdError):
                    child.kill()
                child.close()
            raise PlacementError(f"{sum(c for _, c in shares)} forks of {digest[:12]} failed, "
                                 f"the ones started were killed: {'; '.join(failures)}")
        return children

    def _node_of(self, sandbox: Sandbox) -> NodeState:
        url = sandbox.api.url
        for state in self.directory.alive:
            if state.url == url:
                return state
        raise PlacementError(f"sandbox {sandbox.sandbox_id} is on {url}, which is no alive forkd node of this cluster")

    # teardown

    def kill_children(self) -> list[str]:
        """Kill this driver's children on every alive node (answers their ids)."""
        alive = {state.ray_node_id for state in self.directory.alive}
        refs = [agent.kill_owner.remote(self.owner) for ray_node_id, agent in self.agents.items()
                if ray_node_id in alive]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        killed = []
        for ref in ready:
            with contextlib.suppress(ray.exceptions.RayError):
                killed.extend(ray.get(ref))
        return killed

    def close(self) -> list[str]:
        """Kill this driver's children (answers their ids); leaves Ray up unless this ``Cluster`` started it."""
        killed = self.kill_children()
        if self._owns_ray:
            ray.shutdown()
        return killed

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
