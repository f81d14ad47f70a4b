"""Draining: the daemon stops taking new children while those it runs carry on, so a node can leave
service (a Kubernetes preStop, a host's maintenance) without killing work mid-way.

While draining, every fork is refused before any child starts (the spawner's gate, HTTP 503
``draining``): REST, streamed and keyed forks, the E2B front, workspace starts. Pools stop
refilling. ``GET /v1/node`` says ``draining: true`` with no free slots, so a cluster places nothing
here. Running children keep running and can be used, killed and branched as before. The state is
kept in ``$FORKD_HOME/draining`` (written before the gate closes, removed when it opens), so a
daemon restarted while draining — a crash, an upgrade mid-maintenance — comes back draining.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from forkd.runtime.pool import PoolService
from forkd.runtime.sandboxes import SandboxService
from forkd.runtime.spawning import Spawner
from forkd.store.files import write_json_atomic

POLL_S = 0.1  # how often a drain that waits looks whether children are left (a count, no I/O)


MARKER = "draining"  # the file under FORKD_HOME that says the node drains


class DrainService:
    def __init__(self, spawner: Spawner, pools: PoolService, sandboxes: SandboxService, home: Path) -> None:
        self.spawner, self.pools, self.sandboxes = spawner, pools, sandboxes
        self.marker = home / MARKER

    async def restore(self) -> None:
        """At start, before the pools fill: drain again if the previous daemon was draining."""
        if await asyncio.to_thread(self.marker.exists):
            self._close()

    @property
    def draining(self) -> bool:
        return self.spawner.draining

    async def drain(self, wait_s: float = 0.0) -> dict[str, Any]:
        """Refuse new children from now on (kept across restarts); then wait up to ``wait_s`` for none to be
        left. Answers what is left."""
        if not self.draining:
            await asyncio.to_thread(write_json_atomic, self.marker, {"since": time.time()})
        self._close()
        end = time.monotonic() + wait_s
        while self._left() and time.monotonic() < end:
            await asyncio.sleep(min(POLL_S, max(0.0, end - time.monotonic())))
        return self.state()

    async def undrain(self) -> dict[str, Any]:
        """Take forks again and refill the pools."""
        await asyncio.to_thread(self.marker.unlink, missing_ok=True)
        self.spawner.draining = False
        self.pools.resume()
        return self.state()

    def _close(self) -> None:
        self.spawner.draining = True
        self.pools.pause()

    def state(self) -> dict[str, Any]:
        """Whether it drains, the sandboxes still running and how many children are still starting."""
        return {"draining": self.draining, "sandboxes": [s.record.id for s in self.sandboxes.live()],
                "starting": self.spawner.starting()}

    def _left(self) -> bool:
        return bool(self.sandboxes.live()) or self.spawner.starting() > 0
