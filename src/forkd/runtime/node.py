"""This daemon as one node of many: its id, what it can restore, its free capacity and the snapshots it
holds by digest (``GET /v1/node``), which a cluster places forks and moves snapshots by.

The node id is made once and kept in ``FORKD_HOME/node-id``, so a restarted daemon is the same node.
Everything here that reads files (``/proc``, the snapshots' sizes) runs on a thread.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

from forkd.packs.peer import compat_key, compat_of, snapshot_entry
from forkd.runtime.drain import DrainService
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.sandboxes import SandboxService
from forkd.store.chains import record_digest
from forkd.store.snapshots import SnapshotStore
from forkd.vmm.base import Vmm

NODE_ID_FILE = "node-id"


def node_id(home: Path) -> str:
    """The id kept under ``home``, made on first use (atomically: two starts agree on one)."""
    path = home / NODE_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    made = path.with_name(f".{NODE_ID_FILE}-{secrets.token_hex(4)}")
    made.write_text(f"node-{secrets.token_hex(8)}\n")
    try:
        os.link(made, path)  # fails if another start made it first; theirs is kept
    except FileExistsError:
        pass
    finally:
        made.unlink()
    return path.read_text().strip()


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class NodeService:
    def __init__(self, home: Path, vmm: Vmm, store: SnapshotStore, sandboxes: SandboxService,
                 options: RuntimeOptions, drain: DrainService) -> None:
        self.home, self.vmm = home, vmm
        self.store, self.sandboxes, self.options, self.drain = store, sandboxes, options, drain
        self._id: str | None = None

    async def describe(self) -> dict[str, Any]:
        live = len(self.sandboxes.live())
        return await asyncio.to_thread(self._describe, live, self.drain.draining)

    def _describe(self, live: int, draining: bool) -> dict[str, Any]:
        if self._id is None:
            self._id = node_id(self.home)
        compat = compat_of(self.store.host_identity)
        limit = self.options.max_sandboxes
        free = 0 if draining else None if limit is None else max(0, limit - live)  # a draining node is full
        return {"node_id": self._id, "backend": self.vmm.capabilities().kind, "compat": compat, "compat_key": compat_key(compat),
                "draining": draining,
                "capacity": {"max_sandboxes": limit, "live": live, "slots_free": free,
                             "mem_available_bytes": mem_available_bytes(), "cpus": os.cpu_count() or 1,
                             "load1": round(os.getloadavg()[0], 2)},
                "snapshots": self._snapshots()}

    def _snapshots(self) -> list[dict[str, Any]]:
        # Peers and the cluster place by digest: one still being computed (a full BRANCH's) is waited for.
        records = [r for r in self.store.settle(self.store.registry.list_snapshots()) if "sha256" in r.meta]
        by_tag = {r.tag: r for r in records}
        listed = []
        for record in records:
            parent = by_tag.get(record.parent_tag) if record.parent_tag else None
            size = sum((record.path / name).stat().st_size for name in record.meta["sha256"]
                       if (record.path / name).exists())
            listed.append(snapshot_entry(record, record_digest(parent) if parent else None, size))
        return listed
