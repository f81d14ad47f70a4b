"""What a starting daemon does with what a dead one left, on a real registry and real directories.

No VMM runs here, so nothing can be re-adopted: every record is reaped, and every releaser runs.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from forkd.config import Paths
from forkd.runtime.recovery import recover
from forkd.runtime.sandboxes import SandboxService
from forkd.store.files import DigestCache
from forkd.store.registry import Registry, SandboxRecord, SnapshotRecord
from forkd.store.snapshots import SnapshotStore


def test_records_without_a_vmm_and_orphans_are_released(tmp_path: Path, qemu_sandbox_service: Callable[[Paths, Registry], SandboxService]) -> None:
    paths = Paths(home=tmp_path, cache=tmp_path / "cache", socket=tmp_path / "forkd.sock")
    for directory in (paths.sandboxes, paths.snapshots):
        directory.mkdir(parents=True)
    registry = Registry(paths.db)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs our VMM
    recorded = paths.sandboxes / "sb-recorded0000"
    (recorded / "agent.sock").parent.mkdir()
    (recorded / "agent.sock").touch()
    registry.add_sandbox(SandboxRecord("sb-recorded0000", "base", "running", gone.pid, recorded, time.time()))
    registry.set_vmm("sb-recorded0000", gone.pid, 1, {"monitor_socket": str(recorded / "qmp.sock"),
                                                    "disk": str(recorded / "disk.qcow2")})
    (paths.sandboxes / "sb-norecord0000").mkdir()
    (paths.sandboxes / "not-ours").mkdir()
    for name in (".build-half-0a1b2c3d", "unregistered", "lost+found", "kept"):
        (paths.snapshots / name).mkdir()
    registry.add_snapshot(SnapshotRecord("kept", "ready", "default", paths.snapshots / "kept", 1.0))

    service = qemu_sandbox_service(paths, registry)
    released: list[str] = []
    service.releasers.append(released.append)

    def broken(_: str) -> None:
        raise OSError("this resource cannot be freed")

    service.releasers.insert(0, broken)  # one failing releaser does not stop the others
    store = SnapshotStore(paths.snapshots, registry, DigestCache(), service.vmm.identity, service.vmm.disk)
    result = asyncio.run(recover(service, store))

    assert result.adopted == []
    assert sorted(result.reaped) == ["sb-norecord0000", "sb-recorded0000"]
    assert sorted(released) == ["sb-norecord0000", "sb-recorded0000"]
    assert registry.list_sandboxes() == []
    assert sorted(p.name for p in paths.sandboxes.iterdir()) == ["not-ours"]
    assert sorted(result.removed_builds) == [".build-half-0a1b2c3d", "unregistered"]
    assert sorted(p.name for p in paths.snapshots.iterdir()) == ["kept", "lost+found"]
