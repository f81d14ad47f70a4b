"""Draining a node and reaping a driver's children, on real daemons (the FakeVmm: real processes, the real
guest protocol, no VM) served on loopback TCP behind their tokens, driven through the SDK."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from conftest import vmm_processes_under
from forkd.runtime.options import RuntimeOptions
from forkd.vmm.fake import FakeVmm
from test_e2b_tenants import A, _client, _front, _key
from test_node import bake, expect_error, node, run
from test_runtime_fake_vmm import _runtime
from test_node import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)


async def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition()`` (the scenario's overall bound, ``run``'s, ends a wait that never comes)."""
    while not condition():
        await asyncio.sleep(0.02)


def test_a_draining_node_refuses_forks_while_its_children_carry_on(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a", options=RuntimeOptions(max_sandboxes=5)) as a:
            await bake(a, tmp_path, "base")
            child = (await a.api.fork("base", 1))["sandboxes"][0]["id"]
            assert (await a.api.node())["draining"] is False
            assert await a.api.drain() == {"draining": True, "sandboxes": [child], "starting": 0}
            described = await a.api.node()
            assert described["draining"] is True
            assert (described["capacity"]["live"], described["capacity"]["slots_free"]) == (1, 0)
            message = await expect_error(a.api.fork("base", 2), 503, "draining")
            assert "draining" in message and "DELETE /v1/node/drain" in message
            await expect_error(a.api.fork("base", 1, idempotency_key="k1", owner="job"), 503, "draining")
            await expect_error(a.api.request("POST", "/v1/sandboxes", json={"snapshot_tag": "base", "stream": True}),
                               503, "draining")
            await expect_error(a.api.create_workspace("ws", "base"), 503, "draining")
            assert [s["id"] for s in await a.api.sandboxes()] == [child]  # nothing was started
            # The running child is served as before: commands, a branch, a kill.
            assert (await a.api.exec(child, "true"))["exit_code"] == 0
            assert (await a.api.branch(child, "b1"))["parent_tag"] == "base"
            await a.api.kill(child)
            assert (await a.api.drain())["sandboxes"] == []
            assert await a.api.undrain() == {"draining": False, "sandboxes": [], "starting": 0}
            assert len((await a.api.fork("base", 1, idempotency_key="k1", owner="job"))["sandboxes"]) == 1
            described = await a.api.node()
            assert (described["draining"], described["capacity"]["slots_free"]) == (False, 4)
            await expect_error(a.api.request("POST", "/v1/node/drain", json={"wait_s": -1}), 400, "invalid_request")

    run(scenario)


def test_the_e2b_front_of_a_draining_node_refuses_create_and_fork_before_anything_is_made(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm())
        try:
            async with _client(_front(runtime)) as client:
                made = await client.post("/sandboxes", headers=_key(A), json={"templateID": "base"})
                assert made.status_code == 201, made.text
                sandbox = made.json()["sandboxID"]
                await runtime.drain.drain()
                refused = await client.post("/sandboxes", headers=_key(A), json={"templateID": "base"})
                assert refused.status_code == 503 and "fork on another node" in refused.json()["message"]
                tags = {r.tag for r in runtime.snapshot_records()}
                forked = await client.post(f"/sandboxes/{sandbox}/fork", headers=_key(A), json={"count": 1})
                assert forked.status_code == 503, forked.text
                assert {r.tag for r in runtime.snapshot_records()} == tags  # no branch was written for it
                assert (await client.delete(f"/sandboxes/{sandbox}", headers=_key(A))).status_code == 204
                assert runtime.sandboxes.live() == []
        finally:
            await runtime.stop()

    run(scenario)


def test_a_drain_that_waits_answers_once_the_last_child_is_killed(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a:
            await bake(a, tmp_path, "base")
            children = [s["id"] for s in (await a.api.fork("base", 2))["sandboxes"]]
            waiting = asyncio.create_task(a.api.drain(wait_s=3600))
            await until(lambda: a.runtime.drain.draining)
            await a.api.kill(children[0])
            assert not waiting.done()  # a child is left: it still waits
            await a.api.kill(children[1])
            assert await waiting == {"draining": True, "sandboxes": [], "starting": 0}

    run(scenario)


def test_a_pool_does_not_refill_while_draining(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a:
            await bake(a, tmp_path, "base")
            await a.api.drain()
            pool = await a.api.set_pool_size("base", 2)
            assert (pool["size"], pool["ready"], pool["starting"]) == (2, 0, 0)
            assert sorted(p.name for p in a.runtime.paths.sandboxes.iterdir()) == []  # no member was started
            await a.api.undrain()
            await until(lambda: a.runtime.pools.describe("base")["ready"] == 2)
            members = a.runtime.pools.describe("base")["members"]
            assert (await a.api.fork("base", 1))["sandboxes"][0]["id"] in members  # undrained, it serves forks

    run(scenario)


def test_an_owner_reaped_while_its_fork_starts_leaves_no_child(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a:
            await bake(a, tmp_path, "base")
            kept = (await a.api.fork("base", 1, owner="other"))["sandboxes"][0]["id"]
            a.runtime.vmm.behaviour.reseed_delay_s = 1.0  # the children are slow to answer: the reap comes first
            forking = asyncio.create_task(a.api.fork("base", 2, owner="job"))
            sandboxes = a.runtime.paths.sandboxes
            await until(lambda: len(list(sandboxes.iterdir())) == 3)
            starting = {p.name for p in sandboxes.iterdir()} - {kept}
            assert await a.api.sandboxes(owner="job") == []  # not answered yet: not listed
            assert set(await a.api.kill_owner("job")) == starting  # answered once both were killed
            answer = await forking
            assert answer["sandboxes"] == []
            assert [e["code"] for e in answer["errors"]] == ["sandbox_ended", "sandbox_ended"]
            assert all("reaped" in e["message"] for e in answer["errors"])
            assert await a.api.sandboxes(owner="job") == []
            assert [s["id"] for s in await a.api.sandboxes()] == [kept]
            assert [r.id for r in a.runtime.registry.list_sandboxes()] == [kept]
            assert [p.name for p in sandboxes.iterdir()] == [kept]
            assert len(vmm_processes_under(sandboxes)) == 1

    run(scenario)


def test_an_owner_reaped_while_a_child_queues_for_a_restore_slot_refuses_it_before_it_starts(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a", options=RuntimeOptions(max_concurrent_forks=1)) as a:
            await bake(a, tmp_path, "base")
            a.runtime.vmm.behaviour.reseed_delay_s = 1.0  # the first child holds the one slot a while
            forking = asyncio.create_task(a.api.fork("base", 2, owner="job"))
            sandboxes = a.runtime.paths.sandboxes
            await until(lambda: len(list(sandboxes.iterdir())) == 1 and a.runtime.spawner.starting() == 2)
            [restoring] = [p.name for p in sandboxes.iterdir()]
            assert await a.api.kill_owner("job") == [restoring]  # the queued one never had an id or a VMM
            answer = await forking
            assert answer["sandboxes"] == [] and [e["code"] for e in answer["errors"]] == ["sandbox_ended"] * 2
            assert list(sandboxes.iterdir()) == [] and a.runtime.registry.list_sandboxes() == []

    run(scenario)


def test_a_drain_is_kept_across_a_daemon_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a:
            await bake(a, tmp_path, "base")
            await a.api.drain()
        async with node(tmp_path / "a") as a:  # the same FORKD_HOME: restarted while draining
            described = await a.api.node()
            assert (described["draining"], described["capacity"]["slots_free"]) == (True, 0)
            await expect_error(a.api.fork("base", 1), 503, "draining")
            assert (await a.api.undrain())["draining"] is False
        async with node(tmp_path / "a") as a:  # undrained before the restart: takes forks
            assert (await a.api.node())["draining"] is False
            assert len((await a.api.fork("base", 1))["sandboxes"]) == 1

    run(scenario)
