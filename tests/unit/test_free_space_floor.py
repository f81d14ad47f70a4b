"""A nearly full disk: forks, branches, snapshot builds and uploads are refused with ``disk_full`` (507)
naming what to free, before they write; running sandboxes keep answering; guests get I/O errors
instead of being paused (the VMM's drive flags; the live check is tests/vm/test_faults.py)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import short_tmp_dir
from forkd.daemon.config import load_config
from forkd.errors import kind_for
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.results import CommandSpec
from forkd.runtime.snapshots import SnapshotRequest
from forkd.store import space as space_module
from forkd.store.errors import DiskFull
from forkd.vmm import qemu_machine
from forkd.vmm.base import BootSpec
from forkd.vmm.fake import FakeVmm
from test_runtime_fake_vmm import _image, _runtime, run

MIB = 1 << 20
FLOOR = 64 * MIB


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_tmp_dir("fkd-") as directory:
        yield directory


def _fill_disk(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """Every filesystem now reports ``free`` bytes free (the floor reads nothing else)."""
    real = shutil.disk_usage

    def usage(path: Any) -> Any:
        total, used, _ = real(path)
        return type(real(path))(total, used, free)
    monkeypatch.setattr(space_module.shutil, "disk_usage", usage)


async def _body() -> AsyncIterator[bytes]:
    yield b"never written"


def test_a_full_disk_refuses_fork_branch_snapshot_and_upload_and_the_running_child_still_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> dict[str, Any]:
        runtime = await _runtime(tmp_path, FakeVmm(), options=RuntimeOptions(free_floor_bytes=FLOOR))
        try:
            [outcome] = await runtime.spawner.fork("base", 1)
            child = outcome.sandbox["id"]
            _fill_disk(monkeypatch, FLOOR - MIB)
            refusals: dict[str, Any] = {}
            for name, attempt in (
                    ("fork", lambda: runtime.spawner.fork("base", 2)),
                    ("branch", lambda: runtime.branches.branch(child, "b1")),
                    ("snapshot", lambda: runtime.snapshots.create(SnapshotRequest(tag="s2", memory_mib=1),
                                                                  _image(tmp_path), lambda _line: None)),
                    ("upload", lambda: runtime.sessions.write_file(child, "/tmp/x", _body()))):
                with pytest.raises(DiskFull) as refused:
                    await attempt()
                refusals[name] = refused.value
            answer = await runtime.sessions.exec(child, CommandSpec(argv=["true"]))
            return {"refusals": refusals, "exit": answer.exit_code, "live": len(runtime.sandboxes.live()),
                    "snapshots": sorted(r.tag for r in runtime.registry.list_snapshots())}
        finally:
            await runtime.stop()

    seen = run(scenario)
    for name, error in seen["refusals"].items():
        assert kind_for(error).code == "disk_full" and kind_for(error).status == 507, name
        message = str(error)
        assert "[disk] min_free_mib" in message and "63 MiB are free" in message, (name, message)
        assert "forkd rmi TAG" in message and "forkd kill ID" in message, (name, message)
    assert "forking 2 children of 'base'" in str(seen["refusals"]["fork"])
    assert seen["exit"] == 0 and seen["live"] == 1  # nothing started, the running child untouched
    assert seen["snapshots"] == ["base"]  # no branch or snapshot registered


def test_above_the_floor_everything_proceeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> int:
        runtime = await _runtime(tmp_path, FakeVmm(), options=RuntimeOptions(free_floor_bytes=FLOOR))
        try:
            _fill_disk(monkeypatch, FLOOR + 512 * MIB)
            outcomes = await runtime.spawner.fork("base", 2)
            return sum(o.error is None for o in outcomes)
        finally:
            await runtime.stop()

    assert run(scenario) == 2


def test_the_floor_is_one_daemon_wide_config_key() -> None:
    assert load_config(env={}, overrides={"disk.min_free_mib": 7}).runtime_options.free_floor_bytes == 7 * MIB
    assert load_config(env={}).runtime_options.free_floor_bytes == space_module.DEFAULT_FLOOR_BYTES


def test_the_vmm_reports_disk_errors_to_the_guest_instead_of_pausing_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """QEMU's default werror=enospc pauses a VM whose host disk is full: its agent then stops answering."""
    monkeypatch.setattr(qemu_machine, "machine_type", lambda _binary: "pc-q35-7.2")
    monkeypatch.setattr(qemu_machine, "qemu_version", lambda _binary: "7.2.22")
    spec = BootSpec(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd.img", cmdline="", memory_mib=256, vcpus=1,
                    kernel_sha256="0" * 64, agent_version="0")
    argv = qemu_machine.QemuMachine("qemu-system-x86_64", "tcg", "qemu64").argv(
        spec, tmp_path, tmp_path / "disk.qcow2", tmp_path / "ram", share=False)
    [drive] = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-drive"]
    options = dict(option.partition("=")[::2] for option in drive.split(","))
    assert options["werror"] == "report" and options["rerror"] == "report"


def test_a_fork_over_the_floor_answers_507_disk_full_over_rest(tmp_path: Path) -> None:
    """Refused before any VMM starts (so a real QEMU backend with no VM is enough here)."""
    from fastapi.testclient import TestClient

    from forkd.daemon.app import create_app
    from store_helpers import make_runtime, make_snapshot
    runtime = make_runtime(tmp_path, RuntimeOptions(free_floor_bytes=1 << 60))
    make_snapshot(runtime, "base")
    api = TestClient(create_app(runtime), raise_server_exceptions=False)
    for stream in (False, True):
        refused = api.post("/v1/sandboxes", json={"snapshot_tag": "base", "n": 3, "stream": stream})
        assert refused.status_code == 507, refused.text
        error = refused.json()["error"]
        assert error["code"] == "disk_full" and "forking 3 children of 'base'" in error["message"]
    assert runtime.registry.list_sandboxes() == [] and list(runtime.paths.sandboxes.iterdir()) == []


def test_the_e2b_front_answers_a_full_disk_as_507_naming_what_to_free(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from test_e2b_tenants import A, _client, _front, _key

    async def scenario() -> Any:
        runtime = await _runtime(tmp_path, FakeVmm(), options=RuntimeOptions(free_floor_bytes=FLOOR))
        try:
            _fill_disk(monkeypatch, MIB)
            async with _client(_front(runtime)) as client:
                return await client.post("/sandboxes", headers=_key(A), json={"templateID": "base", "timeout": 60})
        finally:
            await runtime.stop()

    answer = run(scenario)
    assert answer.status_code == 507, answer.text
    assert answer.json()["code"] == 507 and "[disk] min_free_mib" in answer.json()["message"]
