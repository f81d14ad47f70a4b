"""forkd on a Ray cluster: what placement costs, how long replication takes, how fast a dead node's
items answer elsewhere. Run it against a real cluster (docs/scale-out.md: `ray start --head`, then
`forkd node start --ray-address` on every node) from a host that reaches every daemon.

- placement overhead: ``Cluster.create`` (resolve, pick a node, fork through its agent, bind a
  ``Sandbox``) against a plain ``Controller.fork`` on the same node's daemon, p50 of each and the ratio;
- replication: for every ``--replicate TAG``, a pull of that snapshot onto a node that lacks it
  (bytes moved, seconds, MiB/s); the copy is removed afterwards;
- node death (with ``--kill-command``): a map of ``--items`` items; after ``--kill-after`` results the
  command runs (e.g. ``ssh node2 'pkill -9 -f raylet; pkill -9 -f "forkd daemon"'``); reported: seconds
  from the kill until Ray's death notice reached the driver, and until the last retried item answered.

Record the load average around a run (it is in the JSON): figures from a busy machine do not compare.

    .venv/bin/python bench/cluster.py --ray-address HEAD:6379 --tag quickstart --replicate quickstart

or, on this one host (root; bench/cluster_local.py: a Ray head and N forkd nodes on QEMU, each in its
own network namespace with its own FORKD_HOME; node 0 bakes one snapshot per ``--sizes`` entry; the
last node is the one killed):

    .venv/bin/python bench/cluster.py --local 3 --sizes 256,1024 --repeats 20 --items 30 --kill-after 6

Writes bench/results/cluster.json and cluster.png (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from forkd.cluster import Cluster
from forkd.sdk.controller import Controller

RESULTS = Path(__file__).with_name("results")


def placement(cluster: Cluster, tag: str, repeats: int) -> dict[str, Any]:
    """Cluster.create vs a local fork on the node it chose, each sandbox killed right after."""
    via_cluster, local = [], []
    for _ in range(repeats):
        started = time.monotonic()
        sandbox = cluster.create(tag)
        via_cluster.append(time.monotonic() - started)
        node = next(s for s in cluster.directory.alive if s.url == sandbox.api.url)
        sandbox.kill()
        with Controller(url=node.url, token=node.token) as controller:
            local_tag = node.tag_of(cluster.resolve(tag)) or tag
            started = time.monotonic()
            child = controller.fork(local_tag, 1)["sandboxes"][0]["id"]
            local.append(time.monotonic() - started)
            controller.kill(child)
    p50_cluster, p50_local = statistics.median(via_cluster), statistics.median(local)
    return {"cluster_s": via_cluster, "local_s": local, "cluster_p50_s": p50_cluster, "local_p50_s": p50_local,
            "ratio": p50_cluster / p50_local}


def replication(cluster: Cluster, tag: str) -> dict[str, Any]:
    """One pull of ``tag`` onto the best node that lacks it; the copy is removed afterwards."""
    digest = cluster.resolve(tag)
    holders = len(cluster.directory.holders(digest))
    started = time.monotonic()
    [pull] = cluster.replicate(digest, holders + 1)
    seconds = time.monotonic() - started
    target = next(s for s in cluster.directory.alive if s.node_id == pull["target"])
    with Controller(url=target.url, token=target.token) as controller:
        controller.remove_snapshot(pull["tag"])
    return {"tag": tag, "digest": digest, "bytes": pull["bytes"], "layers": pull["pulled_layers"], "seconds": seconds,
            "mib_per_s": pull["bytes"] / (1 << 20) / seconds if seconds else None}


def node_death(cluster: Cluster, tag: str, items: int, kill_after: int, kill_command: str) -> dict[str, Any]:
    """Seconds from a node's kill to Ray's death notice at the driver, and to the last retried answer."""
    def work(sandbox: Any, item: int) -> int:
        sandbox.commands.run("sleep 1")
        return item

    fanout = cluster.map_iter(tag, range(items), work)
    killed_at = last_retry_at = None
    answered = 0
    for outcome in fanout:
        answered += 1
        if outcome.attempts > 1:
            last_retry_at = time.monotonic()
        if answered == kill_after:
            killed_at = time.monotonic()
            subprocess.run(kill_command, shell=True, check=False, timeout=60)
    deaths = [at for at in cluster.deaths.values() if killed_at is not None and at >= killed_at]
    return {"items": items, "answered": answered, "retried": len(fanout.stats.retried),
            "lost_children": fanout.stats.lost_children,
            "death_noticed_s": min(deaths) - killed_at if deaths and killed_at else None,
            "last_retry_answered_s": last_retry_at - killed_at if last_retry_at and killed_at else None}


def plot(report: dict[str, Any], path: Path) -> None:
    """Placement (cluster vs local fork), replication seconds per snapshot, node death."""
    from figures import plt, save  # bench/figures.py; matplotlib when plotting

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    placed = report["placement"]
    left.boxplot([placed["local_s"], placed["cluster_s"]], tick_labels=["local fork", "Cluster.create"])
    left.set_ylabel("seconds")
    left.set_title(f"placement: p50 ratio {placed['ratio']:.2f}x")
    pulls = report["replication"]  # in --replicate order; the bytes moved are what a snapshot's layers hold
    middle.bar([f"{r['tag']}\n{r['bytes'] / (1 << 20):.0f} MiB pulled" for r in pulls], [r["seconds"] for r in pulls])
    middle.set_ylabel("seconds")
    middle.set_title("replication by digest, per snapshot")
    death = report.get("node_death") or {}
    bars = {k: death.get(k) for k in ("death_noticed_s", "last_retry_answered_s") if death.get(k) is not None}
    right.bar(["death noticed", "last retried item answered"][:len(bars)], list(bars.values()))
    right.set_ylabel("seconds after the kill")
    right.set_title(f"node death: {death.get('retried', 0)} items retried" if death else "node death: not run")
    save(figure, path, f"forkd on Ray, {report['nodes']} nodes, load before {report['load_before'][0]:.1f}", dpi=100)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    with Cluster(args.ray_address) as cluster:
        report: dict[str, Any] = {"nodes": len(cluster.directory.alive), "load_before": load_before,
                                  "placement": placement(cluster, args.tag, args.repeats),
                                  "replication": [replication(cluster, tag) for tag in args.replicate]}
        if args.kill_command:
            report["node_death"] = node_death(cluster, args.tag, args.items, args.kill_after, args.kill_command)
    report["load_after"] = os.getloadavg()
    return report


def on_this_host(args: argparse.Namespace) -> None:
    """Set up the local cluster, run this script again in the head's namespace against it, tear down."""
    from cluster_local import local_cluster

    sizes = [int(size) for size in args.sizes.split(",")]
    with local_cluster(args.local, sizes, args.slots, args.vmm) as local:
        inner = [sys.executable, str(Path(__file__).resolve()), "--ray-address", local.address,
                 "--tag", local.tags[min(sizes)], "--repeats", str(args.repeats), "--items", str(args.items),
                 "--kill-after", str(args.kill_after), "--kill-command", local.kill_command, "--out", str(args.out),
                 *[option for size in sizes for option in ("--replicate", local.tags[size])]]
        subprocess.run(["ip", "netns", "exec", local.head_netns, *inner], check=True)
    report = json.loads(args.out.read_text())
    report["setup"] = {"local_nodes": args.local, "sizes_mib": sizes, "slots_per_node": args.slots,
                       "vmm": args.vmm, "one_host": True}
    args.out.write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ray-address", help="the Ray cluster (default $RAY_ADDRESS)")
    parser.add_argument("--local", type=int, metavar="N", help="set up N forkd nodes on this host instead (root)")
    parser.add_argument("--sizes", default="256,1024", help="with --local: snapshot sizes in MiB to replicate")
    parser.add_argument("--slots", type=int, default=4, help="with --local: each node's max_sandboxes")
    parser.add_argument("--vmm", choices=("qemu", "fake"), default="qemu",
                        help="with --local: the nodes' backend (fake: checks the setup, measures nothing real)")
    parser.add_argument("--tag", default="quickstart", help="snapshot (tag or digest) to fork")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--replicate", action="append", default=[], metavar="TAG",
                        help="snapshot to time a pull of (repeatable: several sizes)")
    parser.add_argument("--kill-command", help="shell command that kills one node (all its processes)")
    parser.add_argument("--items", type=int, default=60)
    parser.add_argument("--kill-after", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS / "cluster.json")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.local:
        on_this_host(args)
    else:
        args.out.write_text(json.dumps(measure(args), indent=2))
    report = json.loads(args.out.read_text())
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
