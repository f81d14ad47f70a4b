"""A running sandbox whose last BRANCH was removed (``rmi``) branches again: the new layer has nothing to
chain onto, so it is written standalone from the sandbox's memory and its own disk layers (still in its
run directory), under the removed tag again; the next BRANCH chains onto it, and a child of that one
holds the files written before each BRANCH and the interpreter's state. The logic over the FakeVmm:
tests/unit/test_removed_branch_head.py."""

from __future__ import annotations

import contextlib

import pytest

from forkd.sdk.controller import Controller, ForkdError
from test_branch import child_of, sh, source  # noqa: F401  (source: the fixture, a child of the session snapshot)

pytestmark = pytest.mark.vm


def test_a_branch_after_the_last_one_was_removed_is_standalone_and_keeps_everything(
        daemon: Controller, source: str) -> None:  # noqa: F811
    try:
        daemon.run_code(source, "kept = ['first']")
        sh(daemon, source, "echo disk-1 > /root/first; echo tmpfs-1 > /tmp/first")
        daemon.branch(source, "head-gone", mode="diff")
        assert daemon.remove_snapshot("head-gone") == ["head-gone"]
        daemon.run_code(source, "kept.append('second')")
        sh(daemon, source, "echo disk-2 > /root/second; echo tmpfs-2 > /tmp/second")
        again = daemon.branch(source, "head-gone", mode="diff")  # the removed tag, taken again
        assert again["parent_tag"] is None and daemon.snapshot("head-gone")["depth"] == 0, again
        sh(daemon, source, "echo disk-3 > /root/third")
        on_top = daemon.branch(source, "head-gone-2", mode="diff")
        assert on_top["parent_tag"] == "head-gone" and daemon.snapshot("head-gone-2")["depth"] == 1, on_top
        with child_of(daemon, "head-gone-2") as child:
            assert sh(daemon, child, "cat /root/first /tmp/first /root/second /tmp/second /root/third").split() == [
                "disk-1", "tmpfs-1", "disk-2", "tmpfs-2", "disk-3"]
            assert daemon.run_code(child, "kept")["value"] == "['first', 'second']"
    finally:
        for tag in ("head-gone-2", "head-gone"):
            with contextlib.suppress(ForkdError):
                daemon.remove_snapshot(tag, force=True)
