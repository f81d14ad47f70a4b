"""A cluster driver for the tests. The network-namespace test runs it inside the head node's namespace
(the test's own process cannot reach the namespaces' addresses): it reports JSON lines on stdout and
takes its next step from stdin. ``square`` is the work every cluster test maps.

usage: cluster_driver.py RAY_ADDRESS SNAPSHOT LOG N   (then "again M" on stdin runs M more items)
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def square(sandbox: Any, item: dict[str, Any]) -> int:
    """The work of one item: logs that it started and where (so a retried item shows twice), runs a
    command in its own sandbox (the fake backend answers it without output) and holds the sandbox long
    enough for a node to be killed with the item in flight."""
    with open(item["log"], "a") as log:  # which item started where (the node's daemon URL)
        log.write(f"{item['i']} {os.environ.get('FORKD_URL', '')}\n")
    answer = sandbox.api.exec(sandbox.sandbox_id, f"echo {item['i']}")
    assert answer["exit_code"] == 0 and sandbox.is_running()
    time.sleep(3.0)  # the kill of a node must land inside it, on a loaded machine too
    return int(item["i"]) ** 2


def refuse(sandbox: Any, item: Any) -> None:
    """Work that fails with an SDK error: its error is the item's answer, as itself."""
    from forkd.sdk.errors import NotFoundException

    raise NotFoundException(404, "file_not_found", f"item {item} refused in {sandbox.sandbox_id}")


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def run_map(cluster: Any, snapshot: str, log: str, n: int) -> None:
    fanout = cluster.map_iter(snapshot, [{"i": i, "log": log} for i in range(n)], square)
    for outcome in fanout:
        say(event="result", index=outcome.index, value=outcome.value, node=outcome.node_id,
            error=None if outcome.error is None else repr(outcome.error))
    names = {state.ray_node_id: state.node_id for state in cluster.directory.nodes.values()}
    say(event="summary", retried=fanout.stats.retried, lost=fanout.stats.lost_children,
        duplicates=fanout.stats.duplicates, dead=[names[n] for n in fanout.stats.dead_nodes],
        deaths={names[n]: at for n, at in cluster.deaths.items()}, pulls=cluster.pulls)
    cluster.kill_children()


def main(address: str, snapshot: str, log: str, n: int) -> None:
    from forkd.cluster import Cluster, PlacementError

    cluster = Cluster(address)
    say(event="nodes", nodes={state.url: {"node_id": state.node_id, "digests": [c.digest for c in state.snapshots]}
                              for state in cluster.directory.alive})
    try:
        cluster.map_iter("f" * 64, [0], square)
    except PlacementError as exc:
        say(event="refused", message=str(exc))
    run_map(cluster, snapshot, log, n)
    for line in sys.stdin:
        if line.startswith("again "):
            run_map(cluster, snapshot, log, int(line.split()[1]))
    cluster.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
