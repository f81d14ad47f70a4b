"""The network-namespace cluster both tiers run (tests/unit/test_cluster.py on the fake backend,
tests/vm/test_cluster_vm.py on QEMU): a Ray head and forkd nodes in their own namespaces on a bridge,
each node joined by ``forkd node start``, and ``cluster_driver.py`` run in the head's namespace.
Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from cluster_netns import Bridge
from cluster_nodes import HEALTH_CHECKS, HERE, ForkdNode
from ray.cluster_utils import Cluster as RayCluster

LINE_BOUND_S = 120.0  # the longest the driver may stay silent
RAY_PORT = "6379"


class Driver:
    """``cluster_driver.py`` running in the head's namespace: its JSON lines, each awaited with a bound."""

    def __init__(self, head_ns: str, head: str, *args: str, line_bound_s: float = LINE_BOUND_S) -> None:
        command = ["ip", "netns", "exec", head_ns, sys.executable, str(HERE / "cluster_driver.py"),
                   f"{head}:{RAY_PORT}", *args]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.line_bound_s = line_bound_s
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def next(self) -> dict[str, Any]:
        line = self.lines.get(timeout=self.line_bound_s)
        assert line is not None, f"the driver ended (exit {self.process.wait(10)})"
        return line

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


def start_head(net: Bridge, root: Path) -> tuple[str, str]:
    """A Ray head with no CPUs (no forkd work lands on it) in a namespace of its own: (netns, address);
    Ray's health checks tuned so a dead node is noticed in seconds."""
    head_ns, head = net.add()
    health = {f"RAY_{key}": str(value) for key, value in HEALTH_CHECKS.items()}
    started = subprocess.run(["ip", "netns", "exec", head_ns, str(Path(sys.executable).parent / "ray"), "start",
                              "--head", "--node-ip-address", head, "--port", RAY_PORT, "--num-cpus", "0",
                              "--include-dashboard=false", "--disable-usage-stats",
                              "--temp-dir", str(root / "ray-head")],
                             env={**os.environ, **health}, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stderr
    return head_ns, head


def join(node: ForkdNode, head: str, start_daemon: bool = True) -> None:
    """``forkd node start`` in the node's namespace, attaching the daemon the test started (``--url``) or
    starting it itself (``--listen``); Ray's files kept apart per node."""
    if start_daemon:
        node.start_daemon()
    where = ["--url", node.url] if start_daemon else ["--listen", f"{node.ip}:{node.port}"]
    done = subprocess.run(node.command(sys.executable, "-m", "forkd", "node", "start", "--ray-address",
                                       f"{head}:{RAY_PORT}", *where, "--", "--node-ip-address", node.ip,
                                       "--num-cpus", "1", "--temp-dir", str(node.root / "ray"),
                                       "--disable-usage-stats"),
                          env=node.daemon_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr


def started(log: Path) -> list[tuple[int, str, str]]:
    """(item, daemon URL, sandbox id) of every item's work that started, in order (whole lines only)."""
    lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return [(int(fields[0]), fields[1], fields[2]) for fields in lines if len(fields) == 3]


def wait_for_work(log: Path, url: str, done: set[int]) -> int:
    """The item whose work started last on the node at ``url`` and has not answered (waited for, bounded):
    the latest start leaves the kill the most of the work's time to land in."""
    deadline = time.monotonic() + LINE_BOUND_S
    while time.monotonic() < deadline:
        running = [item for item, where, _ in started(log) if where == url and item not in done]
        if running:
            return running[-1]
        time.sleep(0.05)
    raise AssertionError(f"no work started on {url} within {LINE_BOUND_S:.0f} s")


def moved(log: Path, url: str, answered_by: dict[int, str], dead: str) -> dict[int, int]:
    """Items whose work started on the dead node at ``url`` but which another node answered: how many
    times each one's work started. (Not "the item running when the node was killed": its answer may
    already have been on its way.)"""
    starts = [item for item, _, _ in started(log)]
    return {item: starts.count(item) for item, where, _ in started(log) if where == url and answered_by[item] != dead}


def node_id(node: ForkdNode) -> str:
    with node.controller() as controller:
        return str(controller.request("GET", "/v1/node")["node_id"])


@contextmanager
def raylet_nodes(root: Path, forkd: list[ForkdNode]) -> Iterator[RayCluster]:
    """Ray's own way of testing several nodes on one host: one ``ray.cluster_utils`` raylet per forkd
    node (the first is the head), each node's workers finding its daemon (already started); all of it
    shut down afterwards, daemons included."""
    ray_cluster = RayCluster(initialize_head=True, head_node_args={  # Ray's files under root, not /tmp/ray
        "num_cpus": 1, "resources": {"forkd": 1}, "env_vars": forkd[0].env, "_system_config": HEALTH_CHECKS,
        "temp_dir": str(root / "ray")})
    try:
        forkd[0].ray_node = ray_cluster.head_node
        for node in forkd[1:]:
            node.ray_node = ray_cluster.add_node(num_cpus=1, resources={"forkd": 1}, env_vars=node.env)
        ray_cluster.wait_for_nodes()
        yield ray_cluster
    finally:
        ray.shutdown()
        ray_cluster.shutdown()
        for node in forkd:
            node.stop_daemon()
