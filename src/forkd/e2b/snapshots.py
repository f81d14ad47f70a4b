"""E2B's snapshots on forkd: ``create_snapshot`` is a diff BRANCH of the running sandbox into a
snapshot its caller's owner owns (tag ``e2b-snap-<owner hash>-<name>``), which ``Sandbox.create``
takes as its template; ``list_snapshots`` shows the owner's (every owner's to an admin key);
``delete_snapshot`` hides it at once and removes it when nothing uses it (storage.py).

A snapshot holds the sandbox's memory and disk: a sandbox made from it restores the running state.
``mode="filesystem"`` (a disk-only snapshot that cold-boots) is refused: forkd's guests resume from
memory and cannot boot from a layer's disk alone, and calling a full snapshot filesystem-only would
hand a new sandbox processes and memory the caller asked not to keep.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from forkd.e2b.errors import E2BError
from forkd.e2b.keys import Principal
from forkd.e2b.sandboxes import E2BSandboxes
from forkd.e2b.storage import SNAPSHOT_PREFIX, owned_by, snapshot_prefix
from forkd.store.registry import SnapshotRecord

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,38}$")  # what fits in a tag after the owner's prefix
SOURCE_META = "e2b_sandbox"  # the E2B id a snapshot was taken of (its forkd sandbox changes across pauses)


def info(record: SnapshotRecord) -> dict[str, Any]:
    """E2B's ``SnapshotInfo``: the id is the tag ``Sandbox.create`` takes."""
    return {"snapshotID": record.tag, "names": [record.tag]}


class E2BSnapshots:
    def __init__(self, sandboxes: E2BSandboxes) -> None:
        self.sandboxes = sandboxes
        self.runtime = sandboxes.runtime
        self.storage = sandboxes.storage

    async def create(self, principal: Principal, e2b_id: str, name: str | None, memory: bool | None) -> dict[str, Any]:
        if memory is False:
            raise E2BError(400, "mode=\"filesystem\" is not served by this server: a forkd snapshot is a diff BRANCH of "
                                "memory and disk, and its guests cannot cold-boot from the disk alone; take a full "
                                "snapshot (mode=\"full\", the default): a sandbox made from it resumes the running state")
        if name is not None and not _NAME.fullmatch(name):
            raise E2BError(400, f"snapshot name {name[:80]!r}: use 1-38 characters from A-Z, a-z, 0-9, '_' and '-'")
        resolved = self.sandboxes.resolve(e2b_id, principal)
        if resolved.live is None:
            raise E2BError(409, f"sandbox {e2b_id} is paused; resume it with Sandbox.connect(), then snapshot it")
        tag = snapshot_prefix(principal.owner) + (name or secrets.token_hex(6))
        if self.runtime.snapshot(tag) is not None:
            raise E2BError(409, f"a snapshot named {name!r} exists; delete it (Sandbox.delete_snapshot) or choose "
                                "another name")
        await self.storage.check(principal.owner, f"snapshotting {e2b_id}")
        async with self.sandboxes.lock(e2b_id):
            live = self.sandboxes.resolve(e2b_id, principal).live
            if live is None:
                raise E2BError(409, f"sandbox {e2b_id} was paused meanwhile; resume it, then snapshot it")
            record = await self.runtime.branches.branch(live.record.id, tag, mode="diff", wait=True,
                                                        meta={SOURCE_META: e2b_id})
        return info(record)

    def list(self, principal: Principal, sandbox_id: str | None, name: str | None) -> list[dict[str, Any]]:
        """The caller's ready snapshots (every owner's for admin), newest first."""
        found = [r for r in self.runtime.snapshot_records()
                 if r.status == "ready" and r.tag not in self.storage.doomed
                 and r.tag.startswith(SNAPSHOT_PREFIX) and (principal.admin or owned_by(r.tag, principal.owner))
                 and (sandbox_id is None or r.meta.get(SOURCE_META) == sandbox_id)
                 and (name is None or r.tag == name or r.tag.endswith("-" + name))]
        return [info(r) for r in sorted(found, key=lambda r: r.created_at, reverse=True)]

    async def delete(self, principal: Principal, snapshot_id: str) -> None:
        """Hide it now and remove it when nothing uses it (a sandbox made from it, a later snapshot
        of the same sandbox chained onto it). E2B deletes snapshots and templates on one route: a
        key deletes its owner's snapshots and forks; only an admin key may name another snapshot."""
        record = self.runtime.snapshot(snapshot_id)
        if record is None or record.tag in self.storage.doomed or \
                not (owned_by(record.tag, principal.owner) or principal.admin):
            raise E2BError(404, f"snapshot {snapshot_id!r} was not found; list yours with Sandbox.list_snapshots()")
        await self.storage.doom([record.tag])
        await self.storage.collect()
