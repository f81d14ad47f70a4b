"""A forkd cluster on this one host for ``bench/cluster.py --local N``: a Ray head and N forkd nodes,
each in a network namespace of its own on a bridge (its own FORKD_HOME, daemon on QEMU, joined by
``forkd node start``), built with the tier B test's harness (tests/cluster_harness.py,
tests/cluster_netns.py, tests/cluster_nodes.py), which this imports rather than copies. Needs root
(namespaces) and the guest image (built once into FORKD_CACHE if missing).

The measuring driver must run on a Ray node, so ``bench/cluster.py`` runs itself again inside the
head's namespace against this cluster; killing the last node is killing every process in its namespace.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster_harness import RAY_PORT, join, start_head
from cluster_netns import bridge
from cluster_nodes import ForkdNode


@dataclass(frozen=True)
class LocalCluster:
    head_netns: str
    address: str  # the head's HOST:PORT, reachable inside the namespaces
    tags: dict[int, str]  # snapshot size in MiB -> its tag, held by node 0 only
    kill_command: str  # kills every process of the last node


@contextmanager
def local_cluster(nodes: int, sizes_mib: list[int], slots: int, vmm: str = "qemu") -> Iterator[LocalCluster]:
    """Ray's head and ``nodes`` forkd nodes on QEMU (``vmm="fake"``: the fake backend, which checks the
    setup in seconds but measures nothing real); node 0 bakes one snapshot per size (nothing warmed)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None:
        raise SystemExit("--local needs root, iproute2 and nsenter: its nodes live in network namespaces")
    if nodes < 2:
        raise SystemExit("--local needs at least 2 nodes (one to replicate to, one to kill)")
    root = Path(tempfile.mkdtemp(prefix="fkb-", dir="/tmp"))  # short: Unix socket paths
    try:
        with bridge() as net:
            head_ns, head = start_head(net, root)
            forkd = []
            for i in range(nodes):
                netns, address = net.add()
                forkd.append(ForkdNode(f"n{i}", root / f"n{i}", port=7070, ip=address, netns=netns, vmm=vmm,
                                       slots=slots))
            try:
                for node in forkd:
                    join(node, head)
                if vmm == "qemu":
                    with forkd[0].controller() as n0:  # the machine's cached guest image (built once if missing)
                        n0.build_image(name="default")
                tags = {}
                for size in sizes_mib:
                    tags[size] = f"bench-{size}m"
                    forkd[0].bake(tags[size], memory_mib=size)
                victim = forkd[-1].netns or ""
                kill = f"ip netns pids {shlex.quote(victim)} | xargs -r kill -9"
                yield LocalCluster(head_ns, f"{head}:{RAY_PORT}", tags, kill)
            finally:
                for node in forkd:
                    if node.daemon is not None and node.daemon.poll() is not None:
                        node.start_daemon()  # the killed node's daemon, restarted, reaps what its children left
                    node.stop_daemon()  # kills its sandboxes and removes their namespaces
                for netns in net.namespaces:
                    net.kill_all(netns)  # Ray's processes
    finally:
        shutil.rmtree(root, ignore_errors=True)
