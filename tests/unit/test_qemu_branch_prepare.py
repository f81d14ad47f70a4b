"""The preparation before a BRANCH's pause (vmm/qemu_branch.py): the copy's buffer and the new disk top
are made at once, and when one of them fails the other is undone (no node left in QEMU, no file)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from forkd.vmm import qemu_branch
from forkd.vmm.base import VmHandle


class Monitor:
    """What the preparation asks of QEMU's monitor: the disk's size, then a node added (or not)."""

    def __init__(self, add_fails: bool) -> None:
        self.add_fails = add_fails
        self.commands: list[str] = []

    async def execute(self, command: str, args: dict[str, Any] | None = None) -> Any:
        self.commands.append(command)
        if command == "query-block":
            return [{"device": qemu_branch.ROOT_DRIVE, "inserted": {"image": {"virtual-size": 1 << 20}}}]
        if command == "blockdev-add" and self.add_fails:
            raise RuntimeError("no such file")
        return {}

    async def add_fds(self, fds: list[int], opaque: str) -> str:
        self.commands.append("add-fd")
        return "/dev/fdset/7"


class Process:
    pid = 2 ** 22 + 1  # above pid_max's default: no such process, so its page map cannot be read
    returncode = None


def prepare(tmp_path: Path, add_fails: bool) -> tuple[Monitor, BaseException, list[str]]:
    qmp = Monitor(add_fails)
    vm = VmHandle(name="vm", run_dir=tmp_path, process=Process(), agent_socket=tmp_path / "a")  # type: ignore[arg-type]
    marks: list[str] = []
    with pytest.raises(Exception) as failed:
        asyncio.run(qemu_branch._prepare(qmp, vm, tmp_path / "memory", 1 << 20, tmp_path / "frozen.qcow2",  # type: ignore[arg-type]
                                         tmp_path / "top.qcow2", marks.append))
    return qmp, failed.value, marks


def test_a_buffer_that_cannot_be_made_leaves_no_overlay_node_or_file(tmp_path: Path) -> None:
    qmp, failed, marks = prepare(tmp_path, add_fails=False)
    assert "overlay_prepared" in marks and "buffer_prepared" not in marks
    assert qmp.commands[-1] == "blockdev-del", qmp.commands
    assert not (tmp_path / "top.qcow2").exists()


def test_an_overlay_that_cannot_be_added_leaves_no_file(tmp_path: Path) -> None:
    qmp, _, _ = prepare(tmp_path, add_fails=True)
    assert "blockdev-del" not in qmp.commands and not (tmp_path / "top.qcow2").exists()
    assert qmp.commands[-1] == "remove-fd", qmp.commands  # QEMU's copies of the descriptors closed too
