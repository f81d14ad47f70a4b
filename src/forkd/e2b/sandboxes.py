"""E2B's sandbox lifecycle on forkd's runtime: create, list, connect, timeouts, fork, pause, resume, kill.

An E2B sandbox id names a forkd sandbox, or a workspace once it has been paused: pausing adopts
the sandbox into a workspace named after it and suspends that (a diff BRANCH, then the VMM is
killed, so its memory is freed); resuming forks the workspace's last layer. The E2B id stays the
same across pause/resume while the forkd sandbox behind it changes, so every request resolves
the id first. Fork is a BRANCH of the running sandbox plus N children of that snapshot.
"""

from __future__ import annotations

import datetime
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forkd.e2b.errors import E2BError, lifecycle_error, sandbox_gone
from forkd.e2b.keys import Credentials
from forkd.store.registry import WorkspaceRecord
from forkd.runtime.runtime import Runtime
from forkd.runtime.sandboxes import ForkOptions, LiveSandbox, SandboxNotFound
from forkd.store.errors import SnapshotConflict, SnapshotError
from forkd.validation import ValidationError, check_sandbox_id

# The envd release whose HTTP and RPC paths this front implements (files over multipart and
# octet-stream uploads, stdin control, default user, entry metadata in watch events).
ENVD_VERSION = "0.6.4"
CLIENT_ID = "forkd"
DEFAULT_TIMEOUT_S = 15  # E2B's default when a request names none
MAX_TIMEOUT_S = 30 * 24 * 3600
_WORKSPACE_LABEL = "workspace"  # the label a workspace's sandboxes carry (runtime/workspaces.py)


def rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Resolved:
    """What an E2B id names now: a running forkd sandbox, or a paused workspace."""

    e2b_id: str
    live: LiveSandbox | None
    workspace: WorkspaceRecord | None


class E2BSandboxes:
    def __init__(self, runtime: Runtime, credentials: Credentials) -> None:
        self.runtime = runtime
        self.credentials = credentials

    # ids

    def resolve(self, e2b_id: str) -> Resolved:
        """The sandbox or paused workspace behind ``e2b_id``; 404 in E2B's shape when there is none."""
        workspace = self.runtime.registry.get_workspace(e2b_id) if _plausible(e2b_id) else None
        if workspace is not None:
            if workspace.state == "suspended":
                return Resolved(e2b_id, None, workspace)
            live = self._live(workspace.sandbox_id or "")
            if live is not None:
                return Resolved(e2b_id, live, workspace)
            raise E2BError(404, f"sandbox {e2b_id} was not found: its sandbox ended while it was running")
        live = self._live(e2b_id)
        if live is None:
            raise E2BError(404, f"sandbox {e2b_id} was not found; list running ones with Sandbox.list()")
        return Resolved(e2b_id, live, None)

    def running(self, e2b_id: str) -> LiveSandbox:
        """The running sandbox for sandbox traffic; E2B's proxy answer (502 "was not found") otherwise."""
        try:
            resolved = self.resolve(e2b_id)
        except E2BError:
            raise sandbox_gone(e2b_id) from None
        if resolved.live is None:
            raise sandbox_gone(e2b_id, "it is paused; resume it with Sandbox.connect()")
        return resolved.live

    def _live(self, sandbox_id: str) -> LiveSandbox | None:
        try:
            return self.runtime.sandboxes.get(check_sandbox_id(sandbox_id))
        except (SandboxNotFound, ValidationError):
            return None

    def _e2b_id(self, live: LiveSandbox) -> str:
        """A workspace's sandbox answers to the workspace's name, every other one to its own id."""
        name = live.record.meta.get("metadata", {}).get(_WORKSPACE_LABEL)
        if name:
            workspace = self.runtime.registry.get_workspace(name)
            if workspace is not None and workspace.sandbox_id == live.record.id:
                return name
        return live.record.id

    # shapes

    def created(self, e2b_id: str, template: str) -> dict[str, Any]:
        """E2B's ``Sandbox``: what create, connect and fork answer."""
        return {"sandboxID": e2b_id, "templateID": template, "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
                "envdAccessToken": self.credentials.access_token(e2b_id), "domain": None}

    def _resources(self, tag: str) -> dict[str, int]:
        record = self.runtime.registry.get_snapshot(tag)
        boot = (record.meta.get("boot") or {}) if record is not None else {}
        return {"cpuCount": int(boot.get("vcpus") or 1), "memoryMB": int(boot.get("memory_mib") or 0),
                "diskSizeMB": 0}

    def _labels(self, meta: Mapping[str, Any]) -> dict[str, str]:
        return {k: v for k, v in (meta.get("metadata") or {}).items() if k != _WORKSPACE_LABEL}

    def describe(self, resolved: Resolved, detail: bool = False) -> dict[str, Any]:
        """E2B's ``ListedSandbox`` (``SandboxDetail`` with ``detail``)."""
        if resolved.live is not None:
            record = resolved.live.record
            started, end_at = record.created_at, record.end_at
            template, labels, state = record.snapshot_tag, self._labels(record.meta), "running"
        else:
            workspace = resolved.workspace
            assert workspace is not None
            started, end_at = workspace.created_at, None
            template, labels, state = workspace.meta.get("base_tag", workspace.snapshot_tag), \
                dict(workspace.meta.get("labels", {})), "paused"
        if resolved.workspace is not None:
            started = resolved.workspace.created_at
            template = resolved.workspace.meta.get("base_tag", template)
        info = {"sandboxID": resolved.e2b_id, "templateID": template, "clientID": CLIENT_ID,
                "startedAt": rfc3339(started), "endAt": rfc3339(end_at if end_at is not None else started + MAX_TIMEOUT_S),
                "state": state, "envdVersion": ENVD_VERSION, "metadata": labels, **self._resources(template)}
        if detail:
            info["envdAccessToken"] = self.credentials.access_token(resolved.e2b_id)
            info["domain"] = None
        return info

    # lifecycle

    async def create(self, template: str, timeout_s: int, metadata: dict[str, str],
                     envs: dict[str, str]) -> dict[str, Any]:
        if self.runtime.registry.get_snapshot(template) is None:
            raise E2BError(404, f"template {template!r} not found: templates are forkd snapshots; list them with "
                                "GET /templates or `forkd snapshots`")
        options = ForkOptions(timeout_s=timeout_s, envs=envs, metadata=metadata)
        (outcome,) = await self.runtime.sandboxes.fork(template, 1, options)
        if outcome.sandbox is None:
            raise lifecycle_error(outcome.error.kind, f"the sandbox did not start: {outcome.error}")
        return self.created(outcome.sandbox["id"], template)

    def list(self, metadata: dict[str, str], states: set[str]) -> list[dict[str, Any]]:
        found: list[Resolved] = []
        if "running" in states:
            for live in self.runtime.sandboxes.live():
                if live.record.status == "running" and not live.killing:
                    e2b_id = self._e2b_id(live)
                    workspace = self.runtime.registry.get_workspace(e2b_id) if e2b_id != live.record.id else None
                    found.append(Resolved(e2b_id, live, workspace))
        if "paused" in states:
            found += [Resolved(w.name, None, w) for w in self.runtime.registry.list_workspaces() if w.state == "suspended"]
        described = [self.describe(r) for r in found]
        return [d for d in described if all(d["metadata"].get(k) == v for k, v in metadata.items())]

    async def set_timeout(self, e2b_id: str, timeout_s: int, extend_only: bool = False) -> None:
        live = self.resolve(e2b_id).live
        if live is None:
            raise E2BError(409, f"sandbox {e2b_id} is paused; resume it with Sandbox.connect() first")
        current = live.record.end_at
        if extend_only and current is not None and current >= time.time() + timeout_s:
            return
        await self.runtime.sandboxes.set_timeout(live.record.id, timeout_s)

    async def connect(self, e2b_id: str, timeout_s: int) -> tuple[int, dict[str, Any]]:
        """Resume a paused sandbox (201) or extend a running one's deadline (200)."""
        resolved = self.resolve(e2b_id)
        status = 200
        if resolved.live is None:
            await self.runtime.workspaces.resume(e2b_id)
            status = 201
        await self.set_timeout(e2b_id, timeout_s, extend_only=status == 200)
        return status, self.created(e2b_id, self.describe(self.resolve(e2b_id))["templateID"])

    async def kill(self, e2b_id: str) -> None:
        resolved = self.resolve(e2b_id)
        if resolved.workspace is not None:
            await self.runtime.workspaces.remove(e2b_id)
        elif resolved.live is not None:
            try:
                await self.runtime.sandboxes.kill(resolved.live.record.id)
            except SandboxNotFound:
                raise E2BError(404, f"sandbox {e2b_id} was not found") from None

    async def pause(self, e2b_id: str) -> None:
        resolved = self.resolve(e2b_id)
        if resolved.live is None:
            raise E2BError(409, f"sandbox {e2b_id} is already paused")
        if resolved.workspace is None:
            await self.runtime.workspaces.adopt(e2b_id, resolved.live.record.id)
        try:
            await self.runtime.workspaces.suspend(e2b_id)
        except (SnapshotConflict, SnapshotError) as exc:
            raise E2BError(409, f"sandbox {e2b_id} could not be paused: {exc}") from None

    async def fork(self, e2b_id: str, count: int, timeout_s: int) -> list[dict[str, Any]]:
        """BRANCH the running sandbox (diff layer), then start ``count`` children of it; one result each."""
        live = self.resolve(e2b_id).live
        if live is None:
            raise E2BError(409, f"sandbox {e2b_id} is paused; resume it before forking")
        tag = f"e2b-fork-{secrets.token_hex(6)}"
        await self.runtime.branches.branch(live.record.id, tag, mode="diff", wait=True)
        options = ForkOptions(timeout_s=timeout_s, envs=live.record.meta.get("envs", {}),
                              metadata=self._labels(live.record.meta))
        outcomes = await self.runtime.sandboxes.fork(tag, count, options)
        return [{"sandbox": self.created(o.sandbox["id"], tag)} if o.sandbox is not None
                else {"error": {"code": o.error.kind.status, "message": str(o.error)}} for o in outcomes]

    def templates(self) -> list[dict[str, Any]]:
        """E2B's ``Template`` for every ready forkd snapshot."""
        out = []
        for record in self.runtime.registry.list_snapshots():
            if record.status != "ready":
                continue
            when = rfc3339(record.created_at)
            out.append({"templateID": record.tag, "buildID": record.tag, "public": False, "aliases": [record.tag],
                        "names": [record.tag], "createdAt": when, "updatedAt": when, "createdBy": None,
                        "lastSpawnedAt": None, "spawnCount": self.runtime.sandboxes.count_of(record.tag),
                        "buildCount": 1, "envdVersion": ENVD_VERSION, "buildStatus": "ready",
                        **self._resources(record.tag)})
        return out


def _plausible(name: str) -> bool:
    return 0 < len(name) <= 64 and all(c.isalnum() or c in "-_" for c in name)
