"""Every QMP call is bounded: a VMM whose monitor accepts and then stalls is killed, never waited on.

The "VMM" is a real process (``sleep``) and its monitor a real Unix socket served here: one that
accepts and never greets, and one that negotiates and then never answers a command.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.config import Paths
from forkd.runtime.isolation import Isolation
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.recovery import recover
from forkd.store.registry import Registry, SandboxRecord
from forkd.runtime.sandboxes import SandboxService
from forkd.store.snapshots import SnapshotStore
from forkd.store.files import DigestCache
from forkd.vmm import qemu, qemu_machine
from forkd.vmm.base import VmHandle, VmmError
from forkd.vmm.process import start_time
from forkd.vmm.qemu import QemuVmm

BOUND_S = 20.0
GREETING = {"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, "capabilities": []}}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="qmp-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


async def _stalling_monitor(path: Path, greet: bool) -> asyncio.AbstractServer:
    """Accept; with ``greet``, negotiate capabilities and then never answer again."""

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if greet:
            writer.write(json.dumps(GREETING).encode() + b"\r\n")
            await writer.drain()
            request = json.loads(await reader.read(4096))  # qmp_capabilities (QMP sends no newline)
            answer = {"return": {}, **({"id": request["id"]} if "id" in request else {})}
            writer.write(json.dumps(answer).encode() + b"\r\n")
            await writer.drain()
        await asyncio.sleep(3600)  # stalled: the process is alive, its monitor silent

    return await asyncio.start_unix_server(session, str(path))


@pytest.mark.parametrize("greet", [False, True], ids=["never-greets", "stalls-after-negotiation"])
def test_adopting_a_stalled_vmm_kills_it(short_dir: Path, greet: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qemu, "ADOPT_MONITOR_TIMEOUT_S", 0.5)

    async def scenario() -> tuple[str, int | None]:
        server = await _stalling_monitor(short_dir / "qmp.sock", greet)
        process = await asyncio.create_subprocess_exec("sleep", "3600")
        try:
            with pytest.raises(VmmError) as raised:
                await QemuVmm(accelerator="tcg").adopt("sb-stalled", process, short_dir, {
                    "monitor_socket": str(short_dir / "qmp.sock"), "disk": str(short_dir / "disk.qcow2")})
            return str(raised.value), process.returncode
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            server.close()

    message, returncode = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
    assert "killed" in message and returncode is not None


def test_a_command_that_gets_no_answer_kills_the_vmm(short_dir: Path) -> None:
    async def scenario() -> tuple[str, int | None]:
        server = await _stalling_monitor(short_dir / "qmp.sock", greet=True)
        process = await asyncio.create_subprocess_exec("sleep", "3600")
        vm = VmHandle("sb-stalled", short_dir, process, short_dir / "agent.sock",
                      {"monitor_socket": str(short_dir / "qmp.sock")})
        try:
            with pytest.raises(qemu_machine.MonitorStalled) as raised:
                async with qemu_machine.monitor(vm, wait_s=5, timeout_s=0.3) as qmp:
                    await qmp.execute("stop")
            return str(raised.value), process.returncode
        finally:
            if process.returncode is None:
                process.kill()
            server.close()

    message, returncode = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
    assert "'stop'" in message and returncode is not None


def test_recovery_reaps_a_stalled_vmm_and_finishes(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted daemon's recovery meets a VMM that accepts its monitor and stalls: it is killed and
    its sandbox released, so recovery ends and the daemon serves."""
    monkeypatch.setattr(qemu, "ADOPT_MONITOR_TIMEOUT_S", 0.5)
    paths = Paths(home=short_dir, cache=short_dir / "cache", socket=short_dir / "forkd.sock")
    run_dir = paths.sandboxes / "sb-stalledvmm00"
    run_dir.mkdir(parents=True)
    paths.snapshots.mkdir()
    registry = Registry(paths.db)

    async def scenario() -> tuple[list[str], list[str], int | None]:
        server = await _stalling_monitor(run_dir / "qmp.sock", greet=True)
        # The "VMM" names its run directory on its command line, as QEMU does.
        (run_dir / "console.log").touch()
        process = await asyncio.create_subprocess_exec("tail", "-f", str(run_dir / "console.log"))
        registry.add_sandbox(SandboxRecord("sb-stalledvmm00", "base", "running", process.pid, run_dir, 1.0))
        registry.set_vmm("sb-stalledvmm00", process.pid, start_time(process.pid),
                         {"monitor_socket": str(run_dir / "qmp.sock"), "disk": str(run_dir / "disk.qcow2")})
        vmm = QemuVmm(accelerator="tcg")
        vmm.program = "tail"
        store = SnapshotStore(paths.snapshots, registry, DigestCache(), vmm.identity, vmm.disk)
        service = SandboxService(paths, registry, vmm, Isolation.from_options(registry, RuntimeOptions()))
        try:
            result = await recover(service, store)
            await asyncio.wait_for(process.wait(), 5)
            return result.adopted, result.reaped, process.returncode
        finally:
            if process.returncode is None:
                process.kill()
            server.close()

    adopted, reaped, returncode = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
    assert adopted == [] and reaped == ["sb-stalledvmm00"] and returncode is not None
    assert registry.list_sandboxes() == [] and not run_dir.exists()
