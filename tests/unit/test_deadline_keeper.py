"""The deadline keeper: one failing round never stops it (else no sandbox deadline would be enforced any more)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_runtime_fake_vmm import _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.runtime.keepers import deadline_keeper
from forkd.vmm.fake import FakeVmm


def test_keeper_survives_a_failing_round(tmp_path: Path) -> None:
    async def scenario() -> int:
        runtime = await _runtime(tmp_path, FakeVmm(), tag=None)
        rounds = 0

        async def flaky_expire(now: float | None = None) -> list[str]:
            nonlocal rounds
            rounds += 1
            if rounds == 1:
                raise RuntimeError("a bug in one round")
            return []

        runtime.sandboxes.expire = flaky_expire  # type: ignore[method-assign]
        keeper = asyncio.create_task(deadline_keeper(runtime.sandboxes, interval_s=0.001))
        try:
            for _ in range(2000):  # bounded: at most ~2 s
                if rounds >= 3 or keeper.done():
                    break
                await asyncio.sleep(0.001)
            assert not keeper.done(), "the keeper died"
        finally:
            keeper.cancel()
            runtime.registry.close()
        return rounds

    assert run(scenario) >= 3
