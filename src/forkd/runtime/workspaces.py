"""Workspaces: a named, long-lived sandbox that can be suspended to a snapshot and resumed later.

Suspending is a diff BRANCH of the workspace's sandbox followed by killing it, so its memory and
VMM are freed and only the pages it changed stay on disk; resuming forks a child of that snapshot,
which finds its processes, files and interpreter state as they were. Each suspend adds a layer to
the workspace's chain (``ws-NAME-1``, ``ws-NAME-2``, …); removing the workspace removes them.
That chain is bounded like every other (``max_chain_depth``, runtime/branches.py): a suspend past
the bound writes its layer standalone; :meth:`WorkspaceService.unneeded` then names the earlier
layers the resume no longer needs, and the suspend removes each that nothing else depends on (a
snapshot branched from it, a sandbox forked from it); one kept goes with a later suspend or the
workspace (the E2B front also collects those it kept, e2b/storage.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import Any

from forkd.host.netpolicy import NetRequest, net_request_of
from forkd.runtime.agent_client import AgentUnavailable
from forkd.runtime.branches import BranchService
from forkd.runtime.isolation import SandboxOptions
from forkd.runtime.sandboxes import SandboxEnded, SandboxNotFound, SandboxService
from forkd.runtime.spawning import ForkOptions, Spawner
from forkd.store.chains import registered_ancestors
from forkd.store.errors import SnapshotConflict, SnapshotError
from forkd.store.registry import Registry, WorkspaceRecord
from forkd.validation import ValidationError, check_tag
from forkd.vmm.base import VmmError

MAX_NAME_CHARS = 40  # leaves room for the "ws-NAME-N" snapshot tags within 64 characters


class WorkspaceNotFound(LookupError):
    pass


class WorkspaceService:
    def __init__(self, registry: Registry, sandboxes: SandboxService, spawner: Spawner, branches: BranchService,
                 remove_snapshot: Any) -> None:
        self.registry = registry
        self.sandboxes = sandboxes
        self.spawner = spawner
        self.branches = branches
        self._remove_snapshot = remove_snapshot  # await Runtime.remove_snapshot(tag, cascade=...)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # one change at a time

    def get(self, name: str) -> WorkspaceRecord:
        record = self.registry.get_workspace(name)
        if record is None:
            raise WorkspaceNotFound(f"no workspace {name!r}; list them with `forkd workspace ls`")
        return record

    def find(self, name: str) -> WorkspaceRecord | None:
        return self.registry.get_workspace(name)

    def records(self) -> list[WorkspaceRecord]:
        return self.registry.list_workspaces()

    def describe(self, record: WorkspaceRecord) -> dict[str, Any]:
        """The record, with ``lost`` when its sandbox ended without a suspend (killed, timed out)."""
        info = record.to_dict()
        if record.state == "running" and not any(s.record.id == record.sandbox_id for s in self.sandboxes.live()):
            info["state"] = "lost"
        return info

    @staticmethod
    def _check_name(name: str) -> None:
        check_tag(name)
        if len(name) > MAX_NAME_CHARS:
            raise ValidationError(f"a workspace name has at most {MAX_NAME_CHARS} characters")

    async def create(self, name: str, snapshot_tag: str) -> WorkspaceRecord:
        self._check_name(name)
        async with self._locks[name]:
            if self.registry.get_workspace(name) is not None:
                raise SnapshotConflict(f"workspace {name!r} exists; resume it or remove it with "
                                       f"`forkd workspace rm {name}`")
            sandbox_id = await self._start(name, snapshot_tag)
            record = WorkspaceRecord(name=name, state="running", sandbox_id=sandbox_id, snapshot_tag=snapshot_tag,
                                     created_at=time.time(), meta={"base_tag": snapshot_tag, "suspends": []})
            await asyncio.to_thread(self.registry.put_workspace, record)
            return record

    async def adopt(self, name: str, sandbox_id: str) -> WorkspaceRecord:
        """Make a sandbox that is already running a workspace, so it can be suspended and resumed
        (the E2B front pauses sandboxes this way)."""
        self._check_name(name)
        async with self._locks[name]:
            if self.registry.get_workspace(name) is not None:
                raise SnapshotConflict(f"workspace {name!r} exists")
            tag = self.sandboxes.get(sandbox_id).record.snapshot_tag
            record = WorkspaceRecord(name=name, state="running", sandbox_id=sandbox_id, snapshot_tag=tag,
                                     created_at=time.time(), meta={"base_tag": tag, "suspends": []})
            await asyncio.to_thread(self.registry.put_workspace, record)
            return record

    async def suspend(self, name: str) -> WorkspaceRecord:
        """Save the workspace's sandbox as its next layer, then stop it (memory and VMM freed)."""
        async with self._locks[name]:
            record = self.get(name)
            if record.state != "running":
                raise SnapshotConflict(f"workspace {name!r} is {record.state}; resume it first")
            try:
                self.sandboxes.get(record.sandbox_id or "")
            except SandboxNotFound:
                raise SnapshotConflict(f"workspace {name!r} lost its sandbox {record.sandbox_id} (killed or timed "
                                       "out) before it was suspended; remove it and create it again") from None
            tag = _next_layer(record)
            live = self.sandboxes.get(record.sandbox_id or "")
            # Labels and default environment carry over to the sandbox a resume starts.
            record.meta["labels"] = {k: v for k, v in live.record.meta.get("metadata", {}).items() if k != "workspace"}
            record.meta["envs"] = live.record.meta.get("envs", {})
            record.meta["net"] = live.record.meta.get("net")  # and its network (mode, current egress rules)
            try:
                snapshot = await self.branches.branch(record.sandbox_id, tag, mode="diff", wait=True)
            except (OSError, VmmError, AgentUnavailable, SnapshotError) as exc:
                if await self.sandboxes.ended(record.sandbox_id or ""):
                    raise SandboxEnded(f"workspace {name!r} lost its sandbox {record.sandbox_id} (its timeout or a "
                                       "kill) while it was being suspended, so nothing was saved; remove the "
                                       "workspace and create it again") from exc
                raise
            with contextlib.suppress(SandboxNotFound):  # it ended just after the branch: the layer is saved
                await self.sandboxes.kill(record.sandbox_id)
            record.meta["suspends"].append(tag)
            record.meta["last_pause_ms"] = snapshot.meta.get("pause_ms")
            record.state, record.sandbox_id, record.snapshot_tag = "suspended", None, tag
            await asyncio.to_thread(self.registry.put_workspace, record)
            await self._drop_superseded(name)
            return record

    async def _drop_superseded(self, name: str) -> list[str]:
        """Remove the layers the workspace's snapshot no longer stands on (:meth:`unneeded`), newest first
        (one may stand on an older one), each only if nothing depends on it: a snapshot branched from it or
        a sandbox forked from (or branched onto) it keeps it. Returns the tags removed."""
        in_use = {t for s in self.sandboxes.live() for t in (s.record.snapshot_tag, s.record.head)}
        removed: list[str] = []
        for tag in reversed(self.unneeded(name)):
            if tag in in_use:
                continue
            with contextlib.suppress(SnapshotConflict, LookupError):  # dependents or children: kept for now
                removed += await self._remove_snapshot(tag)
        return removed

    def depth(self, name: str) -> int:
        """How many ancestors the workspace's current snapshot has (0: a standalone snapshot)."""
        record = self.get(name)
        snapshot = self.registry.get_snapshot(record.snapshot_tag)
        return len(registered_ancestors(self.registry, snapshot)) if snapshot is not None else 0

    def unneeded(self, name: str) -> list[str]:
        """The workspace's own layers its current snapshot does not stand on (left below a standalone
        layer): the caller removes them once nothing else (a snapshot branched from one) needs them."""
        record = self.get(name)
        snapshot = self.registry.get_snapshot(record.snapshot_tag)
        needed = {record.snapshot_tag} | {a.tag for a in registered_ancestors(self.registry, snapshot)} \
            if snapshot is not None else {record.snapshot_tag}
        return [t for t in record.meta["suspends"] if t not in needed and self.registry.get_snapshot(t) is not None]

    async def resume(self, name: str) -> WorkspaceRecord:
        """Fork the workspace's last layer: its sandbox runs again where it was suspended."""
        async with self._locks[name]:
            record = self.get(name)
            if record.state != "suspended":
                raise SnapshotConflict(f"workspace {name!r} is already running as {record.sandbox_id}")
            record.sandbox_id = await self._start(name, record.snapshot_tag, record.meta.get("labels", {}),
                                                  record.meta.get("envs", {}), net_request_of(record.meta.get("net")))
            record.state = "running"
            await asyncio.to_thread(self.registry.put_workspace, record)
            return record

    async def set_labels(self, name: str, labels: dict[str, str]) -> None:
        """Replace the labels of the workspace: its running sandbox's, or those its resume starts with."""
        async with self._locks[name]:
            record = self.get(name)
            if record.state == "running":
                await self.sandboxes.set_labels(record.sandbox_id or "", {**labels, "workspace": name})
                return
            record.meta["labels"] = {k: v for k, v in labels.items() if k != "workspace"}
            await asyncio.to_thread(self.registry.put_workspace, record)

    async def remove(self, name: str, keep_layers: bool = False) -> list[str]:
        """Stop its sandbox and remove its layers; returns the snapshot tags removed.

        ``keep_layers``: leave the layers for the caller's collector (the E2B front keeps a layer that
        snapshots of the sandbox were branched from until nothing references it)."""
        async with self._locks[name]:
            record = self.get(name)
            if record.sandbox_id is not None:
                try:
                    await self.sandboxes.kill(record.sandbox_id)
                except SandboxNotFound:
                    pass  # it ended already
            removed: list[str] = []
            for tag in [] if keep_layers else record.meta["suspends"]:  # a standalone one starts a chain of its own
                if self.registry.get_snapshot(tag) is not None:
                    removed += await self._remove_snapshot(tag, cascade=True)
            await asyncio.to_thread(self.registry.remove_workspace, name)
            return removed

    async def _start(self, name: str, snapshot_tag: str, labels: dict[str, str] | None = None,
                     envs: dict[str, str] | None = None, net: NetRequest | None = None) -> str:
        options = ForkOptions(metadata={**(labels or {}), "workspace": name}, envs=envs or {},
                              isolation=SandboxOptions(net=net or NetRequest()))
        (outcome,) = await self.spawner.fork(snapshot_tag, 1, options)
        if outcome.sandbox is None:
            raise SnapshotError(f"the workspace's sandbox did not start: {outcome.error}")
        return outcome.sandbox["id"]


def _next_layer(record: WorkspaceRecord) -> str:
    """The tag of the workspace's next layer (one series, never reused)."""
    return f"ws-{record.name}-{len(record.meta['suspends']) + 1}"
