"""An E2B sandbox paused and resumed many times keeps a bounded chain of layers: a pause past the
daemon's ``max_chain_depth`` writes its layer standalone, and the layers below it are collected once
nothing needs them. On the real front, runtime and registry over the FakeVmm (the VM test,
tests/vm/test_pause_chain_vm.py, checks that files and processes survive; the other paths that add a
layer: tests/unit/test_chain_bound.py)."""

from __future__ import annotations

import time
from pathlib import Path

from test_e2b_api import _create, _front_with
from test_e2b_tenants import A, _client, _key
from test_runtime_fake_vmm import _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.e2b.storage import GRACE_S
from forkd.runtime.options import RuntimeOptions
from forkd.vmm.fake import FakeVmm

BOUND = 3
CYCLES = 10


def test_many_pauses_keep_the_chain_within_the_bound_and_the_replaced_layers_are_collected(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm(), options=RuntimeOptions(max_chain_depth=BOUND))
        front, app = _front_with(runtime)
        try:
            async with _client(app) as client:
                sa = (await _create(client, A))["sandboxID"]
                depths, compacted = [], []
                for cycle in range(CYCLES):
                    if cycle == 4:  # a snapshot the user keeps, branched from a layer a standalone one replaces
                        kept = await client.post(f"/sandboxes/{sa}/snapshots", headers=_key(A), json={})
                        assert kept.status_code == 201, kept.text
                    assert (await client.post(f"/sandboxes/{sa}/pause", headers=_key(A))).status_code == 204
                    workspace = runtime.workspaces.get(sa)
                    info = runtime.describe_snapshot(workspace.snapshot_tag)
                    depths.append(info["depth"])
                    if "compacted_chain" in runtime.snapshot(workspace.snapshot_tag).meta:  # type: ignore[union-attr]
                        compacted.append(workspace.snapshot_tag)
                    resumed = await client.post(f"/sandboxes/{sa}/resume", headers=_key(A), json={})
                    assert resumed.status_code == 201, resumed.text
                    assert front.sandboxes.resolve(sa).live is not None
                assert max(depths) <= BOUND and compacted, depths  # without the bound: 1, 2, ..., 10 (11 with the snapshot)
                # A standalone layer starts the sandbox like any other layer.
                assert runtime.describe_snapshot(compacted[0])["depth"] == 0
                suspends = runtime.workspaces.get(sa).meta["suspends"]
                assert len(set(suspends)) == len(suspends)  # one series of tags, never reused
                # The replaced layers go once nothing needs them (at the pause itself, or collected once a
                # snapshot that stood on one is gone); the user's snapshot keeps its own chain.
                removed = await front.storage.collect(now=time.time() + GRACE_S + 1)
                assert all(runtime.snapshot(t) is None for t in removed)
                left = {r.tag for r in runtime.snapshot_records()}
                assert kept.json()["snapshotID"] in left
                live = front.sandboxes.resolve(sa).live
                assert live is not None and live.record.snapshot_tag in left
                assert len([t for t in suspends if t in left]) <= BOUND + 2  # not one layer per pause
                # Killing it dooms every layer of the series that is left.
                await client.delete(f"/sandboxes/{sa}", headers=_key(A))
                await front.storage.collect(now=time.time() + GRACE_S + 1)
                assert not [t for t in suspends if runtime.snapshot(t) is not None
                            and t not in runtime.describe_snapshot(kept.json()["snapshotID"])["ancestors"]]
        finally:
            await runtime.stop()

    run(scenario)


def test_a_workspace_suspended_past_the_bound_names_the_layers_it_no_longer_needs(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm(), options=RuntimeOptions(max_chain_depth=2))
        try:
            await runtime.workspaces.create("w", "base")
            depths = []
            for _ in range(4):
                await runtime.workspaces.suspend("w")
                depths.append(runtime.workspaces.depth("w"))
                await runtime.workspaces.resume("w")
            assert depths == [1, 2, 0, 1], depths  # the third suspend is written standalone
            # The layers below it were not needed any more: that suspend removed them (nothing depended on them).
            assert runtime.workspaces.unneeded("w") == [] and runtime.snapshot("ws-w-1") is None
            await runtime.workspaces.suspend("w")
            assert runtime.workspaces.get("w").snapshot_tag == "ws-w-5" and runtime.workspaces.depth("w") == 2
            removed = await runtime.workspaces.remove("w")
            assert set(removed) == {f"ws-w-{n}" for n in range(3, 6)}
            assert {r.tag for r in runtime.snapshot_records()} == {"base"}
        finally:
            await runtime.stop()

    run(scenario)


def test_a_superseded_layer_goes_at_a_suspend_once_no_child_and_no_snapshot_depends_on_it(tmp_path: Path) -> None:
    """A REST workspace suspended again and again keeps only the layers something still needs."""
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm(), options=RuntimeOptions(max_chain_depth=2))
        workspaces = runtime.workspaces

        async def cycle() -> str:
            await workspaces.resume("w")
            return (await workspaces.suspend("w")).snapshot_tag

        try:
            await workspaces.create("w", "base")
            assert (await workspaces.suspend("w")).snapshot_tag == "ws-w-1"
            [child] = await runtime.spawner.fork("ws-w-1", 1)  # a sandbox forked from the first layer
            assert child.sandbox is not None
            assert await cycle() == "ws-w-2"
            assert await cycle() == "ws-w-3" and workspaces.depth("w") == 0  # standalone: 1 and 2 superseded
            assert runtime.snapshot("ws-w-2") is None  # nothing depended on it
            assert runtime.snapshot("ws-w-1") is not None  # its child runs
            mine = await runtime.branches.branch(child.sandbox["id"], "mine", mode="diff")
            await runtime.sandboxes.kill(child.sandbox["id"])
            assert mine.parent_tag == "ws-w-1"
            assert await cycle() == "ws-w-4"
            assert runtime.snapshot("ws-w-1") is not None  # a snapshot stands on it
            await runtime.remove_snapshot("mine")
            assert await cycle() == "ws-w-5"
            assert runtime.snapshot("ws-w-1") is None  # a later suspend found it free
            assert {r.tag for r in runtime.snapshot_records()} == {"base", "ws-w-3", "ws-w-4", "ws-w-5"}
            assert set(await workspaces.remove("w")) == {"ws-w-3", "ws-w-4", "ws-w-5"}
        finally:
            await runtime.stop()

    run(scenario)
