"""Pools of ready VMMs on real guests: children as distinct as on-demand ones, refill, rmi, daemon SIGKILL;
and admission: a batch bigger than the restore slots queues and every child answers.

Pools are warm by default: each member has loaded its state, answered a throwaway reseed, a ping and
cells in a scratch context, and waits stopped, so these tests cover warm members (the cold ones,
``warm_pools = false``, only skip that; tests/unit/test_pool.py runs both on the FakeVmm).

These tests run their own daemon (one of them SIGKILLs it) on their own FORKD_HOME.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import vmm_processes_under
from test_faults import Daemon, bake, host_state, own_home, serving, wait_until

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm
TAG = "pooled"
FILL_BOUND_S = 300.0  # members start in the background, one at a time, on a shared machine
PROBE = "(os.urandom(16).hex(), random.random(), float(numpy.random.rand()), socket.gethostname())"


@pytest.fixture(scope="module")
def pool_home() -> Iterator[Path]:
    yield from own_home("forkd-test-pool-")


@pytest.fixture(scope="module")
def pool_snapshot(pool_home: Path) -> str:
    return bake(pool_home, TAG, memory_mib=512, warm_modules=["numpy"])


@pytest.fixture
def daemon(pool_home: Path, pool_snapshot: str) -> Iterator[Daemon]:
    yield from serving(pool_home)


def pool_of(client: Controller, tag: str) -> dict[str, Any]:
    return next((p for p in client.pools() if p["tag"] == tag), {"ready": 0, "members": [], "size": 0})


def fill(client: Controller, tag: str, size: int) -> dict[str, Any]:
    client.set_pool_size(tag, size)
    wait_until(lambda: pool_of(client, tag)["ready"] == size, bound_s=FILL_BOUND_S, step_s=0.2)
    return pool_of(client, tag)


def test_pool_children_are_distinct_private_and_refilled(daemon: Daemon, pool_home: Path) -> None:
    client = daemon.controller
    pool = fill(client, TAG, 2)
    assert pool["warm"] is True and pool["memory"]["private_dirty_kib"] > 0 and len(pool["members"]) == 2
    assert len(vmm_processes_under(pool_home)) == 2  # the members' VMMs, nothing else runs yet
    result = client.fork(TAG, 3)  # one more than the pool: it takes the pool, then starts one itself
    assert result["errors"] == []
    children = result["sandboxes"]
    pooled = [c["id"] for c in children if "pool" in c["timings"]]
    assert sorted(pooled) == sorted(pool["members"])
    assert [c for c in children if c["id"] not in pooled][0]["timings"].get("exec") is not None
    on_demand = [c["id"] for c in children if c["id"] not in pooled][0]
    for child_id in pooled:
        timings = next(c for c in children if c["id"] == child_id)["timings"]
        assert "state_loaded" not in timings and "cont" in timings  # warm: loaded before the fork, only continued
        # The warm-up left nothing a user sees: the contexts are the snapshot's (its scratch one is gone),
        # no process.
        assert [c["id"] for c in client.contexts(child_id)] == [c["id"] for c in client.contexts(on_demand)]
        assert client.processes(child_id) == []
    seen = []
    for child in children:
        # Each child's kernel CRNG was reseeded by its own VMM's vmgenid when its state loaded (a warm
        # member's before its warm-up ran), then by the reseed with the host's entropy.
        vmgenid = client.exec(child["id"], "dmesg | grep -c 'crng reseeded due to virtual machine fork'")
        assert int(vmgenid["stdout"]) >= 1, vmgenid
        client.run_code(child["id"], "import os, random, socket")
        answer = client.eval(child["id"], PROBE)
        assert answer.get("error") is None, answer
        urandom, py_random, np_random, hostname = answer["value_json"]
        assert hostname == child["id"]
        seen.append((urandom, py_random, np_random))
    for column in zip(*seen):
        assert len(set(column)) == len(children), f"identical values across children: {column}"
    writer, other = pooled
    client.exec(writer, "echo mine > /root/pooled.txt && sync")
    assert client.exec(other, "ls /root/pooled.txt 2>/dev/null | wc -l")["stdout"] == "0\n"
    # The pool fills again in the background once the fork is done, with new members.
    refilled = fill(client, TAG, 2)
    assert not set(refilled["members"]) & {c["id"] for c in children}
    for child in children:
        client.kill(child["id"])
    client.set_pool_size(TAG, 0)
    wait_until(lambda: len(vmm_processes_under(pool_home)) == 0, bound_s=30)


def test_rmi_kills_the_pool(daemon: Daemon, pool_home: Path) -> None:
    client = daemon.controller
    client.create_snapshot("doomed", memory_mib=256, warm_modules=[])
    members = fill(client, "doomed", 2)["members"]
    assert client.remove_snapshot("doomed") == ["doomed"]
    wait_until(lambda: not vmm_processes_under(pool_home) and
               not any((pool_home / "sandboxes" / m).exists() for m in members), bound_s=30)
    assert all(p["tag"] != "doomed" for p in client.pools())


def test_daemon_sigkill_with_a_pool_leaks_nothing(daemon: Daemon, pool_home: Path) -> None:
    client = daemon.controller
    before = host_state(pool_home)
    fill(client, TAG, 2)
    daemon.kill9()
    assert len(vmm_processes_under(pool_home)) == 2  # the members outlived their daemon
    daemon.start()  # reaps them (run directories without a record), then fills the pool anew
    members = fill(client, TAG, 2)["members"]
    state = host_state(pool_home)
    assert state["vmms"] == 2 and state["run_dirs"] == sorted(members) and state["records"] == before["records"]
    client.set_pool_size(TAG, 0)
    wait_until(lambda: host_state(pool_home) == before, bound_s=30)


def test_admission_queues_a_batch_and_every_child_answers(pool_home: Path, pool_snapshot: str) -> None:
    """20 at once through 2 restore slots: the rest wait their turn; each answers within its own window."""
    daemon = Daemon(pool_home)
    config = pool_home / "admission.toml"
    config.write_text("[limits]\nmax_concurrent_forks = 2\n")
    daemon.start("--config", str(config))
    try:
        client = daemon.controller
        started = time.monotonic()
        lines = list(client.fork_iter(TAG, 20))
        print(f"\n20 children through 2 restore slots: last answered after {time.monotonic() - started:.1f} s")
        assert sorted(line["index"] for line in lines) == list(range(20))
        assert [line.get("error") for line in lines] == [None] * 20
        queued = sorted(line["timings"]["queued"] for line in lines)
        assert queued[-1] > queued[0]  # the later ones did wait for a slot
        for line in lines:
            assert client.ping(line["sandbox"]["id"])
            client.kill(line["sandbox"]["id"])
    finally:
        daemon.stop()
    assert host_state(pool_home)["vmms"] == 0
