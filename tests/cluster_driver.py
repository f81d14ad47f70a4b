"""A cluster driver for the tests. The network-namespace test runs it inside the head node's namespace
(the test's own process cannot reach the namespaces' addresses): it reports JSON lines on stdout and
takes its next step from stdin. ``square`` is the work the fake-backend tests map, ``square_in_guest``
the work of the QEMU test (tests/vm/test_cluster_vm.py): the guest's own Python computes the answer.

usage: cluster_driver.py RAY_ADDRESS SNAPSHOT LOG N [WORK]   (then "again M" on stdin runs M more items)
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

HOLD_S = 3.0  # how long the work holds its sandbox: the kill of a node must land inside it, on a loaded machine too


def started(sandbox: Any, item: dict[str, Any]) -> None:
    """Logs which item started where (the node's daemon URL) in which sandbox: a retried item shows twice."""
    with open(item["log"], "a") as log:
        log.write(f"{item['i']} {os.environ.get('FORKD_URL', '')} {sandbox.sandbox_id}\n")


def square(sandbox: Any, item: dict[str, Any]) -> int:
    """The work of one item: runs a command in its own sandbox (the fake backend answers it without
    output) and holds the sandbox long enough for a node to be killed with the item in flight."""
    started(sandbox, item)
    answer = sandbox.api.exec(sandbox.sandbox_id, f"echo {item['i']}")
    assert answer["exit_code"] == 0 and sandbox.is_running()
    time.sleep(HOLD_S)
    return int(item["i"]) ** 2


def square_in_guest(sandbox: Any, item: dict[str, Any]) -> int:
    """The work of one item in a real guest: its Python squares the item; the answer is what it printed."""
    started(sandbox, item)
    answer = sandbox.api.exec(sandbox.sandbox_id, ["python3", "-c", f"print({int(item['i'])} ** 2)"],
                              timeout_s=120)
    assert answer["exit_code"] == 0, answer
    time.sleep(HOLD_S)
    return int(answer["stdout"])


def refuse(sandbox: Any, item: Any) -> None:
    """Work that fails with an SDK error: its error is the item's answer, as itself."""
    from forkd.sdk.errors import NotFoundException

    raise NotFoundException(404, "file_not_found", f"item {item} refused in {sandbox.sandbox_id}")


WORK = {"square": square, "square_in_guest": square_in_guest}


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def run_map(cluster: Any, snapshot: str, log: str, n: int, work: Any = square) -> None:
    fanout = cluster.map_iter(snapshot, [{"i": i, "log": log} for i in range(n)], work)
    for outcome in fanout:
        say(event="result", index=outcome.index, value=outcome.value, node=outcome.node_id,
            error=None if outcome.error is None else repr(outcome.error))
    names = {state.ray_node_id: state.node_id for state in cluster.directory.nodes.values()}
    say(event="summary", retried=fanout.stats.retried, lost=fanout.stats.lost_children,
        duplicates=fanout.stats.duplicates, dead=[names[n] for n in fanout.stats.dead_nodes],
        deaths={names[n]: at for n, at in cluster.deaths.items()}, pulls=cluster.pulls)
    cluster.kill_children()


def main(address: str, snapshot: str, log: str, n: int, work: str = "square") -> None:
    from forkd.cluster import Cluster, PlacementError

    cluster = Cluster(address)
    say(event="nodes", nodes={state.url: {"node_id": state.node_id, "digests": [c.digest for c in state.snapshots]}
                              for state in cluster.directory.alive})
    try:
        cluster.map_iter("f" * 64, [0], square)
    except PlacementError as exc:
        say(event="refused", message=str(exc))
    run_map(cluster, snapshot, log, n, WORK[work])
    for line in sys.stdin:
        if line.startswith("again "):
            run_map(cluster, snapshot, log, int(line.split()[1]))
    cluster.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:6])
