"""Every path that adds a layer to a chain keeps it within ``max_chain_depth``: a BRANCH whose parent
already has that many ancestors is written standalone (whole memory, flattened disk, no parent), and
what every round wrote is still there in a child of the last snapshot. On the real runtime and
registry over the FakeVmm; E2B's pause loop is tests/unit/test_pause_chain.py, real guests
tests/vm/test_chain_bound_vm.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from test_e2b_api import _create, _front_with
from test_e2b_tenants import A, B, _client, _key
from test_runtime_fake_vmm import _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.daemon.config import load_config
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.runtime import Runtime
from forkd.vmm.fake import FakeVmm

BOUND = 3
ROUNDS = 10  # without the bound the last depth is 10
PAGE = 4096


def _on_bounded(tmp_path: Path, body: Callable[[Runtime], Awaitable[None]]) -> None:
    """``body`` on a runtime over the FakeVmm whose chains are bounded at ``BOUND``."""
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm(), options=RuntimeOptions(max_chain_depth=BOUND))
        try:
            await body(runtime)
        finally:
            await runtime.stop()

    run(scenario)


def _sees_every_round(runtime: Runtime, sandbox_id: str, rounds: int) -> bool:
    """Whether the child's RAM holds the page each round wrote (laid in from the chain at restore)."""
    with open(runtime.sandboxes.get(sandbox_id).vm.state["ram"], "rb") as ram:
        pages = []
        for n in range(rounds):
            ram.seek((n + 1) * PAGE)
            pages.append(ram.read(16))
    return pages == [f"round {n}".encode().ljust(16, b"\0") for n in range(rounds)]


def _write(runtime: Runtime, sandbox_id: str, n: int) -> None:
    vmm = runtime.vmm
    assert isinstance(vmm, FakeVmm)
    vmm.write_guest_memory(runtime.sandboxes.get(sandbox_id).vm, (n + 1) * PAGE, f"round {n}".encode())


def test_branching_one_sandbox_in_a_loop_keeps_its_chain_within_the_bound(tmp_path: Path) -> None:
    """REST BRANCH (and E2B's snapshot and fork) of one live sandbox, again and again."""
    async def scenario(runtime: Runtime) -> None:
        [outcome] = await runtime.spawner.fork("base", 1)
        source = outcome.sandbox["id"]
        depths = []
        for n in range(ROUNDS):
            _write(runtime, source, n)
            record = await runtime.branches.branch(source, f"s{n}", mode="diff")
            depths.append(runtime.describe_snapshot(record.tag)["depth"])
        assert depths == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2], depths
        standalone = runtime.snapshot("s3")
        assert standalone is not None and standalone.parent_tag is None
        assert standalone.meta["compacted_chain"] == ["s2", "s1", "s0", "base"]
        assert standalone.meta["memory_kind"] == "full"
        [child] = await runtime.spawner.fork(f"s{ROUNDS - 1}", 1)
        assert _sees_every_round(runtime, child.sandbox["id"], ROUNDS)
        # The layers below a standalone one are its ancestors no more: removable on their own.
        assert await runtime.remove_snapshot("s0", cascade=True)
        assert runtime.snapshot("s3") is not None

    _on_bounded(tmp_path, scenario)


def test_forking_a_child_of_a_child_in_a_loop_keeps_the_chain_within_the_bound(tmp_path: Path) -> None:
    """Fork the last snapshot, write, BRANCH the child, kill it; again from the new snapshot."""
    async def scenario(runtime: Runtime) -> None:
        tag, depths = "base", []
        for n in range(ROUNDS):
            [outcome] = await runtime.spawner.fork(tag, 1)
            child = outcome.sandbox["id"]
            _write(runtime, child, n)
            tag = (await runtime.branches.branch(child, f"c{n}", mode="diff")).tag
            await runtime.sandboxes.kill(child)
            depths.append(runtime.describe_snapshot(tag)["depth"])
        assert max(depths) <= BOUND and depths.count(0) >= 2, depths
        [last] = await runtime.spawner.fork(tag, 1)
        assert _sees_every_round(runtime, last.sandbox["id"], ROUNDS)

    _on_bounded(tmp_path, scenario)


def test_e2b_snapshots_of_sandboxes_made_from_snapshots_keep_the_chain_within_the_bound(tmp_path: Path) -> None:
    """E2B's loop: create_snapshot, then Sandbox.create from that snapshot, then snapshot the new one."""
    async def scenario(runtime: Runtime) -> None:
        _, app = _front_with(runtime)
        async with _client(app) as client:
            template, depths = "base", []
            for _ in range(ROUNDS):
                sandbox = (await _create(client, A, templateID=template))["sandboxID"]
                made = await client.post(f"/sandboxes/{sandbox}/snapshots", headers=_key(A), json={})
                assert made.status_code == 201, made.text
                template = made.json()["snapshotID"]
                depths.append(runtime.describe_snapshot(template)["depth"])
                assert (await client.post(f"/sandboxes/{sandbox}/pause", headers=_key(A))).status_code == 204
                assert (await client.delete(f"/sandboxes/{sandbox}", headers=_key(A))).status_code == 204
            assert max(depths) <= BOUND and depths.count(0) >= 2, depths
            listed = await client.get("/snapshots", headers=_key(A))
            assert len(listed.json()) == ROUNDS  # standalone ones are the caller's snapshots like any other
            # A standalone layer has no parent, yet holds a sandbox's memory: never another owner's template.
            others = {t["templateID"] for t in (await client.get("/templates", headers=_key(B))).json()}
            assert others == {"base"}, others

    _on_bounded(tmp_path, scenario)


def test_the_bound_is_one_daemon_setting_and_the_e2b_key_is_folded_into_it(tmp_path: Path) -> None:
    path = tmp_path / "forkd.toml"
    path.write_text("[limits]\nmax_chain_depth = 5\n")
    config = load_config(path, env={})
    assert config.runtime_options.max_chain_depth == 5 and config.deprecations() == []
    path.write_text("[limits]\nmax_chain_depth = 5\n\n[e2b]\nmax_pause_chain = 3\n")
    config = load_config(path, env={})
    assert config.runtime_options.max_chain_depth == 3
    assert "max_chain_depth" in config.deprecations()[0]
    path.write_text("[e2b]\nmax_pause_chain = 0\n")  # once "never compact": every chain is bounded now
    assert load_config(path, env={}).runtime_options.max_chain_depth == RuntimeOptions().max_chain_depth
    path.write_text("[limits]\nmax_chain_depth = 0\n")
    with pytest.raises(ValueError, match="max_chain_depth"):  # 0 would be no chain at all
        load_config(path, env={})
