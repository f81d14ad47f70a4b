"""The deadline keeper: one failing round or one sandbox that cannot be killed never stops it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from forkd.config import Paths
from forkd.runtime.isolation import Isolation
from forkd.runtime.metrics import Metrics
from forkd.runtime.registry import Registry
from forkd.runtime.sandboxes import SandboxService
from forkd.runtime.snapshots import SnapshotService
from forkd.store.files import DigestCache
from forkd.vmm.qemu import QemuVmm


class FlakyService(SandboxService):
    """expire() raises on its first round, then counts the rounds that follow."""

    rounds = 0

    async def expire(self, now: float | None = None) -> list[str]:
        self.rounds += 1
        if self.rounds == 1:
            raise RuntimeError("a bug in one round")
        return []


def test_keeper_survives_a_failing_round(tmp_path: Path) -> None:
    paths = Paths(home=tmp_path, cache=tmp_path / "cache", socket=tmp_path / "forkd.sock")
    registry = Registry(paths.db)
    vmm = QemuVmm(accelerator="tcg")
    service = FlakyService(paths, registry, vmm, SnapshotService(paths, registry, vmm, DigestCache()), Metrics(),
                           Isolation(registry, None, None, None))  # type: ignore[arg-type]

    async def run() -> int:
        keeper = asyncio.create_task(service.expire_forever(interval_s=0.001))
        for _ in range(2000):  # bounded: at most ~2 s
            if service.rounds >= 3 or keeper.done():
                break
            await asyncio.sleep(0.001)
        alive = not keeper.done()
        keeper.cancel()
        assert alive, "the keeper died"
        return service.rounds

    assert asyncio.run(run()) >= 3
