"""Tier A of forkd on Ray (docs/scale-out.md). Every node has its own real ``forkd daemon`` process
on the fake VMM backend (``FORKD_VMM=fake``), with its own FORKD_HOME and TCP with a token.

The map test stands hosts in with network namespaces on a bridge the test makes: a Ray head and three
forkd nodes, each joined by ``forkd node start``; the snapshot on node 0 only; ``Cluster.map`` over 30
items; after 8 results every process of node 2 is killed. The create/fork test runs its three nodes as
``ray.cluster_utils.Cluster`` raylets. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the cluster tests need the forkd[ray] extra (scripts/setup installs it)")
from ray.cluster_utils import Cluster as RayCluster  # noqa: E402

import cluster_driver  # noqa: E402
from cluster_harness import (  # noqa: E402
    LINE_BOUND_S, RAY_PORT, Driver, join, moved, node_id, raylet_nodes, start_head, wait_for_work)
from cluster_netns import bridge, left_behind  # noqa: E402
from cluster_nodes import SLOTS, ForkdNode  # noqa: E402
from conftest import run_in_own_process  # noqa: E402
from forkd.cluster import Cluster, PlacementError  # noqa: E402
from forkd.cluster.actor import dead_jobs  # noqa: E402
from forkd.sdk.errors import NotFoundException  # noqa: E402

pytestmark = pytest.mark.timeout(600)
TAG = "base"
DEATH_BOUND_S = 10.0  # the issue's bound on noticing node 2's death, with the health checks tuned
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2")


@pytest.fixture
def root() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="fkc-", dir="/tmp"))  # short: Unix socket paths
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@needs_root
def test_map_survives_a_node_dying_and_a_restarted_node_takes_work(root: Path) -> None:
    with bridge() as net:
        head_ns, head = start_head(net, root)
        forkd = []
        for i in range(3):
            netns, address = net.add()
            forkd.append(ForkdNode(f"n{i}", root / f"n{i}", port=7070, ip=address, netns=netns))
        for node in forkd:
            join(node, head)
        forkd[0].bake(TAG)
        ids = {node.name: node_id(node) for node in forkd}

        # `forkd cluster status` in the head's namespace sees the three nodes and what each holds
        status = subprocess.run(["ip", "netns", "exec", head_ns, sys.executable, "-m", "forkd", "cluster", "status",
                                 "--ray-address", f"{head}:{RAY_PORT}", "--json"],
                                capture_output=True, text=True, timeout=180)
        assert status.returncode == 0, status.stderr
        shown = {n["url"]: n for n in json.loads(status.stdout)["nodes"]}
        assert sorted(shown) == sorted(node.url for node in forkd)
        assert [shown[node.url]["node_id"] for node in forkd] == [ids[node.name] for node in forkd]
        digest = shown[forkd[0].url]["snapshots"][0]["digest"]
        assert not shown[forkd[1].url]["snapshots"] and not shown[forkd[2].url]["snapshots"]

        log = root / "started.log"
        driver = Driver(head_ns, head, TAG, str(log), "30")
        try:
            assert driver.next()["event"] == "nodes"
            refused = driver.next()  # bad input: a digest nobody holds, refused naming the nodes asked
            assert refused["event"] == "refused" and "held by none of the alive nodes" in refused["message"]
            assert all(name in refused["message"] for name in ids.values())

            results: dict[int, int] = {}
            answered_by: dict[int, str] = {}
            killed_at = None
            while (line := driver.next())["event"] == "result":
                assert line["error"] is None, line["error"]
                assert line["index"] not in results  # exactly once
                results[line["index"]] = line["value"]
                answered_by[line["index"]] = line["node"]
                if len(results) == 8:  # every process of node 2 (raylet, workers, daemon, VMMs) once it runs one
                    wait_for_work(log, forkd[2].url, done=set(results))
                    killed_at = time.monotonic()
                    assert net.kill_all(forkd[2].netns or "")
            summary = line
            assert results == {i: i * i for i in range(30)}

            # node 2 seen dead within the bound; its items in flight ran again elsewhere
            assert killed_at is not None and summary["dead"] == [ids["n2"]]
            assert summary["deaths"][ids["n2"]] - killed_at <= DEATH_BOUND_S
            assert not summary["lost"] or summary["retried"]  # none lost when node 2 had finished its items
            rerun = moved(log, forkd[2].url, answered_by, ids["n2"])
            # (an item lost while its fork was still on the way to node 2 never started there)
            assert all(n >= 2 for n in rerun.values()), f"node 2's lost items did not run again: {rerun}"

            # node 1 pulled the snapshot from node 0 by digest and lists the digest it computed itself
            assert any(p["target"] == ids["n1"] and p["source"] == ids["n0"] and p["digest"] == digest
                       for p in summary["pulls"])
            with forkd[1].controller() as n1:
                assert digest in {s["digest"] for s in n1.request("GET", "/v1/node")["snapshots"]}

            # the survivors hold no sandboxes and nothing leaked (VMM processes, run directories)
            for node in forkd[:2]:
                with node.controller() as controller:
                    assert controller.sandboxes() == []
                assert node.vmm_pids() == [], f"{node.name} left VMM processes"
                assert not any((node.home / "sandboxes").glob("*")), f"{node.name} left run directories"

            # node 2 comes back (a replaced host: a fresh FORKD_HOME; `forkd node start` starts its daemon),
            # rejoins, pulls and takes work
            back = ForkdNode("n2b", root / "n2b", port=7070, ip=forkd[2].ip, netns=forkd[2].netns)
            join(back, head, start_daemon=False)
            back_id = node_id(back)
            driver.send(f"again {3 * SLOTS}")
            again: dict[int, str] = {}
            while (line := driver.next())["event"] == "result":
                assert line["error"] is None and line["value"] == line["index"] ** 2
                again[line["index"]] = line["node"]
            assert sorted(again) == list(range(3 * SLOTS))
            assert back_id in again.values(), "the restarted node took no work"
            assert any(p["target"] == back_id and p["digest"] == digest for p in line["pulls"])
        finally:
            driver.close()
    assert not (left := left_behind(net)), f"namespaces, veths or the bridge of the test left behind: {left}"


@pytest.fixture
def nodes(root: Path) -> Iterator[tuple[RayCluster, list[ForkdNode]]]:
    forkd = [ForkdNode(f"n{i}", root / f"n{i}") for i in range(3)]
    for node in forkd:
        node.start_daemon()
    forkd[0].bake(TAG)
    with raylet_nodes(root, forkd) as ray_cluster:
        ray.cloudpickle.register_pickle_by_value(cluster_driver)  # the workers cannot import tests/unit
        yield ray_cluster, forkd


DRIVER = """
import sys, time
import ray
ray.init(address=sys.argv[1], namespace="forkd")
from forkd.cluster import Cluster
sandbox = Cluster().create(sys.argv[2], timeout_s=None)
print(sandbox.sandbox_id, flush=True)
time.sleep(600)
"""


def forkd_cli(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forkd", *args, "--ray-address", address], capture_output=True,
                          text=True, timeout=120)


def test_a_ray_address_nothing_answers_on_is_refused_at_once() -> None:
    for command in (["cluster", "status"], ["node", "start"]):
        done = forkd_cli("127.0.0.1:1", *command)
        assert done.returncode == 1 and "nothing answers at the Ray address 127.0.0.1:1" in done.stderr


def test_dead_drivers_are_read_from_ray_without_its_dashboard_in_a_process_of_its_own() -> None:
    run_in_own_process(f"{Path(__file__).relative_to(Path(__file__).parents[2])}::"
                       "test_dead_drivers_are_read_from_ray_without_its_dashboard")


@pytest.mark.own_process
def test_dead_drivers_are_read_from_ray_without_its_dashboard() -> None:
    """The reaper's one private Ray call (``forkd.cluster.actor.dead_jobs``) against the Ray installed,
    on a head with no dashboard: a driver that ended is dead, this one is not. Fails if Ray moves it."""
    # A local head made by ray.init writes a token to ~/.ray/auth_token unless told not to, and every other
    # Ray started on this host would then need it (the map test's `ray start` nodes failed to join).
    os.environ["RAY_AUTH_MODE"] = "disabled"
    head = ray.init(num_cpus=1, include_dashboard=False, namespace="forkd")
    try:
        mine = ray.get_runtime_context().get_job_id()
        script = "import sys, ray; ray.init(address=sys.argv[1]); print(ray.get_runtime_context().get_job_id())"
        driver = subprocess.run([sys.executable, "-c", script, head.address_info["address"]],
                                capture_output=True, text=True, timeout=120, check=False)
        assert driver.returncode == 0, driver.stderr[-3000:]
        ended = driver.stdout.split()[-1]
        deadline = time.monotonic() + 60
        while ended not in dead_jobs() and time.monotonic() < deadline:
            time.sleep(0.2)
        dead = dead_jobs()
        assert ended in dead and mine not in dead, (ended, mine, dead)
    finally:
        ray.shutdown()


def by_url(cluster: Cluster, node: ForkdNode) -> Any:
    return next(state for state in cluster.directory.alive if state.url == node.url)


def test_create_fork_spill_replicate_and_reap_in_a_process_of_its_own() -> None:
    """Its Ray driver runs in the test's process: in the suite's own, Ray's core worker outlived
    ``ray.shutdown()`` and one full run crashed with SIGSEGV a few hundred tests later."""
    run_in_own_process(f"{Path(__file__).relative_to(Path(__file__).parents[2])}::"
                       "test_create_fork_spill_replicate_and_reap")


@pytest.mark.own_process
def test_create_fork_spill_replicate_and_reap(nodes: tuple[RayCluster, list[ForkdNode]], root: Path) -> None:
    ray_cluster, forkd = nodes
    ray.init(address=ray_cluster.address, namespace="forkd")
    cluster = Cluster()
    digest = cluster.resolve(TAG)

    # what the work raises is the item's answer: map raises the first item's error once every item finished
    with pytest.raises(NotFoundException, match="item 0 refused in sb-"):
        cluster.map(TAG, [0, 1], cluster_driver.refuse)

    # create: the SDK's Sandbox, bound to the only holder; fork beyond its free slots spills elsewhere
    sandbox = cluster.create(TAG)
    assert sandbox.api.url == forkd[0].url and sandbox.is_running()
    with pytest.raises(PlacementError, match=f"no room for .* of {3 * SLOTS} forks of {sandbox.sandbox_id}"):
        cluster.fork(sandbox, 3 * SLOTS)  # the parent holds one of the cluster's slots
    children = cluster.fork(sandbox, SLOTS + 2)
    assert len(children) == SLOTS + 2 and all(child.is_running() for child in children)
    where = [child.api.url for child in children]
    assert where.count(forkd[0].url) == SLOTS - 1  # the parent holds the home node's last slot
    branch = {p["digest"] for p in cluster.pulls} - {digest}
    assert len(branch) == 1 and all(p["source"] == cluster.directory.nodes[
        next(s.ray_node_id for s in cluster.directory.alive if s.url == forkd[0].url)].node_id for p in cluster.pulls)
    assert cluster.kill_children() and all(not child.is_running() for child in children)

    # `forkd cluster replicate`: the tag onto every node (spilling the branch brought its base to one
    # node already), then refused past the nodes there are
    holders = len(cluster.refresh().holders(digest))
    assert holders == 2
    done = forkd_cli(ray_cluster.address, "cluster", "replicate", TAG, "--to", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"pulled {digest[:12]}") == 1
    too_many = forkd_cli(ray_cluster.address, "cluster", "replicate", TAG, "--to", "4")
    assert too_many.returncode == 1 and "only 3 alive node(s) can hold" in too_many.stderr
    for node in forkd:
        with node.controller() as controller:
            assert digest in {s["digest"] for s in controller.request("GET", "/v1/node")["snapshots"]}
    table = forkd_cli(ray_cluster.address, "cluster", "status")
    assert table.returncode == 0 and all(state.node_id in table.stdout for state in cluster.directory.alive)
    assert table.stdout.count(f"base@{digest[:12]}") == 3

    # a driver that dies leaves children behind; the agents reap them by its (dead) Ray job
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, ray_cluster.address, TAG], stdout=subprocess.PIPE,
                              text=True)
    try:
        orphan = driver.stdout.readline().strip() if driver.stdout else ""
    finally:
        driver.kill()
        driver.wait(30)
    assert orphan
    deadline = time.monotonic() + 60
    reaped: list[str] = []
    while orphan not in reaped and time.monotonic() < deadline:
        reaped += [child for state in cluster.directory.alive
                   for child in ray.get(ray.get_actor(f"forkd-node-{state.ray_node_id}").reap_dead_drivers.remote())]
        time.sleep(0.5)
    assert orphan in reaped

    # an agent whose process dies (its node alive) is restarted by Ray; its items run again, once each
    agent = ray.get_actor(f"forkd-node-{by_url(cluster, forkd[1]).ray_node_id}")
    first_pid = ray.get(agent.pid.remote())
    log = root / "agent.log"
    log.touch()
    killer = threading.Thread(target=lambda: (wait_for_work(log, forkd[1].url, set()),
                                              os.kill(first_pid, signal.SIGKILL)))
    killer.start()  # the agent dies with an item's work running on it
    fanout = cluster.map_iter(TAG, [{"i": i, "log": str(log)} for i in range(2 * SLOTS)], cluster_driver.square)
    results = {}
    for outcome in fanout:
        assert outcome.error is None and outcome.index not in results
        results[outcome.index] = outcome.value
    killer.join(LINE_BOUND_S)
    assert results == {i: i * i for i in range(2 * SLOTS)}
    assert fanout.stats.retried and fanout.stats.dead_nodes == []
    assert ray.get(agent.pid.remote(), timeout=60) != first_pid
    cluster.close()
