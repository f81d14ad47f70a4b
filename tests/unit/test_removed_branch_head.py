"""A sandbox whose last BRANCH was removed (``rmi``, E2B's ``delete_snapshot``) while it runs on: its next
BRANCH has no layer to chain onto, so it is written standalone (whole memory, its disk flattened from the
sandbox's own layers) and the chain goes on from it; the removed tag may be taken again. And the head a
restarted daemon reads is never behind the layers published. On the real runtime and registry over the
FakeVmm; real guests: tests/vm/test_branch_head_removed_vm.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from test_chain_bound import _sees_every_round, _write
from test_runtime_fake_vmm import _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.runtime.runtime import Runtime
from forkd.vmm.fake import FakeVmm


def test_a_sandbox_whose_last_branch_was_removed_branches_again_standalone(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime: Runtime = await _runtime(tmp_path, FakeVmm())
        try:
            [outcome] = await runtime.spawner.fork("base", 1)
            source = outcome.sandbox["id"]
            _write(runtime, source, 0)
            await runtime.branches.branch(source, "b1", mode="diff")
            for n, tag in enumerate(("b1", "c1"), start=1):  # the removed head's own tag again, then another
                assert await runtime.remove_snapshot("b1") == ["b1"]
                _write(runtime, source, n)
                record = await runtime.branches.branch(source, tag, mode="diff")
                assert record.status == "ready" and record.parent_tag is None, record
                assert record.meta["memory_kind"] == "full" and record.meta["compacted_chain"] == ["base"]
                if tag == "c1":
                    break
            _write(runtime, source, 3)
            on_top = await runtime.branches.branch(source, "d1", mode="diff")  # the chain goes on from c1
            assert on_top.parent_tag == "c1" and on_top.meta["memory_kind"] == "diff"
            for tag, rounds in (("c1", 3), ("d1", 4)):
                [child] = await runtime.spawner.fork(tag, 1)
                assert child.error is None, child.error
                assert _sees_every_round(runtime, child.sandbox["id"], rounds)
        finally:
            await runtime.stop()

    run(scenario)


def test_the_head_a_restarted_daemon_reads_moves_with_the_publish(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon dying right after publishing a BRANCH must not leave the sandbox's recorded head behind:
    the next branch would chain onto the older layer and its disk would lack what this one froze."""
    async def scenario() -> None:
        runtime: Runtime = await _runtime(tmp_path, FakeVmm())
        try:
            [outcome] = await runtime.spawner.fork("base", 1)
            source = outcome.sandbox["id"]
            recorded: list[str | None] = []
            publish = runtime.store.publish

            def publish_then_die(*args: Any, **kwargs: Any) -> None:
                publish(*args, **kwargs)
                record = runtime.registry.get_sandbox(source)  # what a daemon restarted now would read
                recorded.append(record.branch_head if record else None)

            monkeypatch.setattr(runtime.store, "publish", publish_then_die)
            for tag in ("b1", "b2"):
                await runtime.branches.branch(source, tag, mode="diff")
            assert recorded == ["b1", "b2"]
        finally:
            await runtime.stop()

    run(scenario)


@pytest.mark.parametrize("taken_by", ["another sandbox's branch", "a compaction of another sandbox's branch",
                                      "nobody: the head failed"])
def test_a_head_that_is_not_this_sandboxs_usable_layer_is_not_chained_onto(tmp_path: Path, taken_by: str) -> None:
    """Chaining onto another sandbox's layer would lay this sandbox's pages over that one's memory and its
    disk layer over that one's disk (and hand one tenant's data to another)."""
    async def scenario() -> None:
        runtime: Runtime = await _runtime(tmp_path, FakeVmm())
        try:
            [one, other] = await runtime.spawner.fork("base", 2)
            source = one.sandbox["id"]
            _write(runtime, source, 0)
            await runtime.branches.branch(source, "x", mode="diff")
            assert runtime.snapshot("x").meta["source_sandbox"] == source  # type: ignore[union-attr]
            if taken_by == "nobody: the head failed":
                runtime.store.mark_failed("x", "a file of it changed on disk")
            else:
                assert await runtime.remove_snapshot("x") == ["x"]
                if taken_by == "another sandbox's branch":
                    await runtime.branches.branch(other.sandbox["id"], "x", mode="diff")
                else:
                    await runtime.branches.branch(other.sandbox["id"], "o", mode="diff")
                    await runtime.compaction.compact("o", "x")
            _write(runtime, source, 1)
            record = await runtime.branches.branch(source, "y", mode="diff")
            assert record.parent_tag is None and record.meta["compacted_chain"] == ["base"], record
            [child] = await runtime.spawner.fork("y", 1)
            assert _sees_every_round(runtime, child.sandbox["id"], 2)
        finally:
            await runtime.stop()

    run(scenario)
