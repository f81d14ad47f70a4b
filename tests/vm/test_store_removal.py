"""Removing a multi-gigabyte snapshot runs off the daemon's event loop: forks and evals started while it
is being deleted complete, and answer correctly. (How long they wait is measured by bench/, not here.)"""

from __future__ import annotations

import threading
import time

import pytest

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm

BIG_MIB = 3072
# Fills 2.5 GiB of the guest's RAM with non-zero bytes (so the memory file holds that much real data)
# and keeps it alive in the snapshot.
FILL = ("python3 -c \"import time; kept = b'\\x01' * (2560 << 20); print('{\\\"ready\\\": true}', flush=True); "
        "time.sleep(86400)\"")


def test_removing_a_multi_gigabyte_snapshot_while_forks_and_evals_run(daemon: Controller, snapshot_tag: str) -> None:
    big = "vmtest-big"
    daemon.create_snapshot(big, memory_mib=BIG_MIB, warm_modules=[], warmup_cmd=FILL)
    listed = {s["tag"]: s for s in daemon.snapshots()}
    assert listed[big]["disk"]["physical_bytes"] > 2 << 30  # really multi-gigabyte on disk

    forked = daemon.fork(snapshot_tag, 2)
    assert forked["errors"] == []
    children = [s["id"] for s in forked["sandboxes"]]
    removed: list[object] = []

    def remove() -> None:
        with Controller(url=daemon.url) as other:
            removed.append(other.remove_snapshot(big))

    remover = threading.Thread(target=remove)
    try:
        remover.start()
        rounds = 0
        deadline = time.monotonic() + 600
        while (remover.is_alive() or rounds < 3) and time.monotonic() < deadline:
            for i, child in enumerate(children):
                assert daemon.eval(child, f"{rounds} * 10 + {i}")["value"] == str(rounds * 10 + i)
            more = daemon.fork(snapshot_tag, 1)
            assert more["errors"] == []
            extra = more["sandboxes"][0]["id"]
            assert daemon.eval(extra, "int(numpy.arange(5).sum())")["value"] == "10"
            daemon.kill(extra)
            rounds += 1
        remover.join(timeout=600)
        assert not remover.is_alive() and removed == [[big]]
        assert big not in {s["tag"] for s in daemon.snapshots()}
    finally:
        for child in children:
            daemon.kill(child)
