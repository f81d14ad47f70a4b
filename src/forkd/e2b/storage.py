"""What E2B's users leave on disk: fork snapshots, their own snapshots and pause layers; who owns
which, the per-owner quota, and the collector that removes what nothing uses.

Every such snapshot is a diff layer: a later BRANCH of the same sandbox (another snapshot, a fork,
a pause) is written on top of it, and a child forked from it maps it. So a layer can be removed
only when no live sandbox was forked from it or has it as its head (its next BRANCH chains onto
it) and no other snapshot was branched from it. ``e2b-fork-*`` snapshots are collected as soon as
that holds; a snapshot the user deleted and the pause layers of a killed sandbox are hidden at
once (their tags are kept in ``$FORKD_HOME/e2b/doomed.json``) and removed when it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path

from forkd.e2b.errors import E2BError
from forkd.runtime.runtime import Runtime
from forkd.store.errors import SnapshotError
from forkd.store.files import write_json_atomic
from forkd.store.registry import SnapshotRecord
from forkd.store.usage import directory_usage

OWNER_LABEL = "forkd.e2b-owner"  # a sandbox's owner, stored with it (a pause carries it into the workspace)
FORK_PREFIX = "e2b-fork-"
SNAPSHOT_PREFIX = "e2b-snap-"
GRACE_S = 60.0  # a layer younger than this is never collected: its fork may not have started its children yet
log = logging.getLogger("forkd.e2b.storage")


def owner_hash(owner: str) -> str:
    """Owners may be long: snapshot tags name theirs by a hash, so listings can filter on the tag."""
    return hashlib.sha256(owner.encode()).hexdigest()[:16]


def fork_prefix(owner: str) -> str:
    return f"{FORK_PREFIX}{owner_hash(owner)}-"


def snapshot_prefix(owner: str) -> str:
    return f"{SNAPSHOT_PREFIX}{owner_hash(owner)}-"


def owned_by(tag: str, owner: str) -> bool:
    return tag.startswith((fork_prefix(owner), snapshot_prefix(owner)))


class Storage:
    def __init__(self, runtime: Runtime, quota_bytes: int | None = None) -> None:
        self.runtime = runtime
        self.quota_bytes = quota_bytes
        self._doomed_file = runtime.paths.home / "e2b" / "doomed.json"
        self.doomed: set[str] = self._load()

    # the doomed set

    def _load(self) -> set[str]:
        try:
            tags = json.loads(self._doomed_file.read_text())
        except FileNotFoundError:
            return set()
        except (OSError, ValueError) as exc:  # a damaged file loses only the collection of those layers
            log.warning("%s unreadable (%s): layers it named stay until removed with `forkd rmi`",
                        self._doomed_file, exc)
            return set()
        return {t for t in tags if isinstance(t, str)} if isinstance(tags, list) else set()

    async def doom(self, tags: list[str]) -> None:
        """Hide ``tags`` now and remove them once nothing references them."""
        self.doomed |= set(tags)
        await self._save()

    async def _save(self) -> None:
        tags = sorted(self.doomed)
        self._doomed_file.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(write_json_atomic, self._doomed_file, tags)

    # space

    async def check(self, owner: str | None, why: str) -> None:
        """Refuse ``why`` (a BRANCH about to be written) when the disk is below the daemon's free-space
        floor (``disk_full``, 507) or ``owner`` is over its quota, with what to do next."""
        await asyncio.to_thread(self.runtime.space.check, self.runtime.paths.snapshots, 0, why)
        if owner is None or self.quota_bytes is None:
            return
        used = await self.usage(owner)
        if used >= self.quota_bytes:
            raise E2BError(507, f"disk quota exceeded: {why} refused, your snapshots, forks and paused sandboxes "
                                f"use {used >> 20} MiB of {self.quota_bytes >> 20} MiB; delete snapshots "
                                "(Sandbox.delete_snapshot) or kill paused sandboxes, then retry")

    async def usage(self, owner: str) -> int:
        """Bytes on disk of the owner's snapshots, fork snapshots and pause layers (hard links counted once)."""
        layers = {w.name: list(w.meta.get("suspends", [])) for w in self.runtime.workspaces.records()
                  if (w.meta.get("labels") or {}).get(OWNER_LABEL) == owner}
        paths = [r.path for r in self.runtime.snapshot_records()
                 if owned_by(r.tag, owner) or any(r.tag in tags for tags in layers.values())]
        return await asyncio.to_thread(lambda: sum(directory_usage(p)["physical_bytes"] for p in paths))

    # collection

    def referenced(self, records: list[SnapshotRecord]) -> set[str]:
        """Tags something still needs: a live sandbox's template or head, another snapshot's parent,
        a paused workspace's last layer, a build in progress."""
        needed = {r.parent_tag for r in records if r.parent_tag}
        needed |= {r.tag for r in records if r.status == "writing"}
        for live in self.runtime.sandboxes.live():
            needed |= {live.record.snapshot_tag, live.record.head}
        needed |= {w.snapshot_tag for w in self.runtime.workspaces.records() if w.state == "suspended"}
        return {t for t in needed if t} | {r.tag for r in records if self.runtime.spawner.count_of(r.tag)}

    async def collect(self, now: float | None = None) -> list[str]:
        """Remove every collectable layer nothing references; repeated until a pass removes none
        (a chain goes from its tip down). Returns the tags removed."""
        now = time.time() if now is None else now
        removed: list[str] = []
        while True:
            records = self.runtime.snapshot_records()
            needed = self.referenced(records)
            doomed = [r.tag for r in records if (r.tag.startswith(FORK_PREFIX) or r.tag in self.doomed)
                      and r.tag not in needed and (r.tag in self.doomed or now - r.created_at >= GRACE_S)]
            gone = []
            for tag in doomed:
                with contextlib.suppress(SnapshotError, LookupError):  # raced with a fork or a removal: next round
                    gone += await self.runtime.remove_snapshot(tag)
            removed += gone
            if not gone:
                break
        known = {r.tag for r in self.runtime.snapshot_records()}
        if self.doomed - known:
            self.doomed &= known
            await self._save()
        if removed:
            log.info("removed E2B layers nothing references: %s", ", ".join(removed))
        return removed
