"""E2B's sandbox lifecycle on forkd's runtime: create, list, connect, timeouts, fork, pause, resume, kill.

An E2B sandbox id names a forkd sandbox, or a workspace once it has been paused: pausing adopts
the sandbox into a workspace named after it and suspends that (a diff BRANCH, then the VMM is
killed, so its memory is freed); resuming forks the workspace's last layer. Every layer (pause,
snapshot, fork) is held to the daemon's ``[limits] max_chain_depth`` by the BRANCH itself
(runtime/branches.py): a pause past it writes a standalone layer, and the layers below it go to the
collector (storage.py) once the resume no longer needs them. The E2B id stays the
same across pause/resume while the forkd sandbox behind it changes, so every request resolves
the id first. Fork is a BRANCH of the running sandbox plus N children of that snapshot.

Ownership and the token nonce are labels of the forkd sandbox (``forkd.e2b-owner``,
``forkd.e2b-nonce``): the registry keeps them with the sandbox, a pause carries them into the
workspace and a resume back, so they survive both and daemon restarts. Every control-plane call
resolves with the caller's :class:`Principal`: another owner's object answers as absent.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forkd.e2b.errors import E2BError, lifecycle_error, sandbox_gone, to_http
from forkd.e2b.keys import Credentials, Principal
from forkd.e2b.lifecycle import Policy, granted, pause_at, timed
from forkd.e2b.storage import OWNER_LABEL, Storage, fork_prefix, owned_by
from forkd.host.netpolicy import EgressPolicy, NetRequest, net_request_of
from forkd.runtime.isolation import SandboxOptions
from forkd.store.registry import SnapshotRecord, WorkspaceRecord
from forkd.runtime.runtime import Runtime
from forkd.runtime.sandboxes import LiveSandbox, NetworkModeConflict, SandboxNotFound
from forkd.runtime.spawning import ForkOptions
from forkd.store.errors import SnapshotConflict, SnapshotError
from forkd.validation import ValidationError, check_sandbox_id

# The envd release whose HTTP and RPC paths this front implements (files over multipart and
# octet-stream uploads, stdin control, default user, entry metadata in watch events).
ENVD_VERSION = "0.6.4"
CLIENT_ID = "forkd"
DEFAULT_TIMEOUT_S = 15  # E2B's default when a request names none
MAX_TIMEOUT_S = 30 * 24 * 3600
_WORKSPACE_LABEL = "workspace"  # the label a workspace's sandboxes carry (runtime/workspaces.py)
NONCE_LABEL = "forkd.e2b-nonce"
PUBLIC_LABEL = "forkd.e2b-public"  # "true": the sandbox's own ports answer without its token (allowPublicTraffic)
# A snapshot holding some sandbox's state: a BRANCH, or a flattened chain (compacted, or a BRANCH written
# standalone at the chain's bound: no parent, yet a sandbox's memory).
_DERIVED_META = ("source_sandbox", "compacted_chain")
log = logging.getLogger("forkd.e2b")


def reserved_label(key: str) -> bool:
    return key == _WORKSPACE_LABEL or key.startswith("forkd.")


def rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Resolved:
    """What an E2B id names now: a running forkd sandbox, or a paused workspace."""

    e2b_id: str
    live: LiveSandbox | None
    workspace: WorkspaceRecord | None

    @property
    def labels(self) -> dict[str, str]:
        """Every label, reserved ones included: the running sandbox's, else the paused workspace's."""
        if self.live is not None:
            return dict(self.live.record.meta.get("metadata") or {})
        return dict((self.workspace.meta.get("labels") if self.workspace else None) or {})

    @property
    def owner(self) -> str | None:
        return self.labels.get(OWNER_LABEL)

    @property
    def nonce(self) -> str:
        """The token nonce; a workspace made outside the front (none stored) uses its creation time."""
        stored = self.labels.get(NONCE_LABEL)
        if stored:
            return stored
        return repr(self.workspace.created_at) if self.workspace is not None else ""


class E2BSandboxes:
    def __init__(self, runtime: Runtime, credentials: Credentials, storage: Storage,
                 domain: str | None = None) -> None:
        self.runtime = runtime
        self.credentials = credentials
        self.storage = storage
        self.domain = domain  # what the SDKs' get_host(port) builds on: {port}-{sandboxID}.{domain}
        # One lifecycle change at a time per E2B id: a resume, a pause (asked for, or at the timeout)
        # and a kill never interleave, and two requests to a paused sandbox resume it once.
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, e2b_id: str) -> asyncio.Lock:
        return self._locks.setdefault(e2b_id, asyncio.Lock())

    def _forget(self, e2b_id: str) -> None:
        lock = self._locks.get(e2b_id)
        if lock is not None and not lock.locked():
            del self._locks[e2b_id]

    async def prune_locks(self) -> None:
        """The keeper's round: drop the locks of ids that ended some other way (REST, timeout)."""
        for e2b_id in [i for i in self._locks if not self.exists(i)]:
            self._forget(e2b_id)

    # ids

    def resolve(self, e2b_id: str, principal: Principal | None = None) -> Resolved:
        """The sandbox or paused workspace behind ``e2b_id``; 404 in E2B's shape when there is none or
        it belongs to another owner than ``principal``'s (None: sandbox traffic, the token decides)."""
        resolved = self._resolve(e2b_id)
        if principal is not None and not principal.sees(resolved.owner):
            raise E2BError(404, f"sandbox {e2b_id} was not found; list running ones with Sandbox.list()")
        return resolved

    def _resolve(self, e2b_id: str) -> Resolved:
        workspace = self.runtime.workspaces.find(e2b_id) if _plausible(e2b_id) else None
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

    async def running(self, e2b_id: str, tokens: list[str]) -> LiveSandbox:
        """The running sandbox for sandbox traffic carrying ``tokens`` (401 unless every one is its
        token); a paused one with ``autoResume`` is resumed first; E2B's proxy answer (502 "was not
        found") when it is not running."""
        try:
            resolved = self.resolve(e2b_id)
        except E2BError:
            raise sandbox_gone(e2b_id) from None
        if not all([self.credentials.access_token_valid(e2b_id, resolved.nonce, t) for t in tokens]):
            raise E2BError(401, f"wrong access token for sandbox {e2b_id}: use the envdAccessToken the API "
                                "returned when the sandbox was created or connected")
        if resolved.live is None:
            if not (tokens and Policy.of(resolved.labels).auto_resume):  # a token-less /health wakes nothing
                raise sandbox_gone(e2b_id, "it is paused; resume it with Sandbox.connect()")
            try:
                resolved = await self._resume(e2b_id, None)
            except Exception as exc:
                raise to_http(exc) from exc
            assert resolved.live is not None
        return resolved.live

    async def _resume(self, e2b_id: str, timeout_s: int | None) -> Resolved:
        """Resume the paused sandbox (if a request under the same lock did not already); a pausing one
        gets ``timeout_s`` (None: the timeout it was created with) from now."""
        async with self.lock(e2b_id):
            resolved = self.resolve(e2b_id)
            if resolved.live is None:
                await self.runtime.workspaces.resume(e2b_id)
                resolved = self.resolve(e2b_id)
                if Policy.of(resolved.labels).pause:
                    await self._set_pause_at(resolved, granted(resolved.labels) if timeout_s is None else timeout_s)
                    resolved = self.resolve(e2b_id)
            return resolved

    async def _set_pause_at(self, resolved: Resolved, timeout_s: int) -> None:
        assert resolved.live is not None
        await self.runtime.sandboxes.set_labels(resolved.live.record.id, {**resolved.labels, **timed(timeout_s)})

    def exists(self, e2b_id: str) -> bool:
        try:
            self._resolve(e2b_id)
        except E2BError:
            return False
        return True

    def public(self, e2b_id: str) -> bool:
        """Whether the sandbox was created with ``allowPublicTraffic``: its ports need no token (envd still does)."""
        try:
            return self._resolve(e2b_id).labels.get(PUBLIC_LABEL) == "true"
        except E2BError:
            return False

    def _live(self, sandbox_id: str) -> LiveSandbox | None:
        try:
            return self.runtime.sandboxes.get(check_sandbox_id(sandbox_id))
        except (SandboxNotFound, ValidationError):
            return None

    def e2b_id(self, live: LiveSandbox) -> str:
        """A workspace's sandbox answers to the workspace's name, every other one to its own id."""
        name = live.record.meta.get("metadata", {}).get(_WORKSPACE_LABEL)
        if name:
            workspace = self.runtime.workspaces.find(name)
            if workspace is not None and workspace.sandbox_id == live.record.id:
                return name
        return live.record.id

    # shapes

    def created(self, e2b_id: str, template: str, nonce: str) -> dict[str, Any]:
        """E2B's ``Sandbox``: what create, connect and fork answer. The SDKs send ``envdAccessToken``
        to envd and ``trafficAccessToken`` to the code interpreter's context routes: one token here."""
        token = self.credentials.access_token(e2b_id, nonce)
        return {"sandboxID": e2b_id, "templateID": template, "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
                "envdAccessToken": token, "trafficAccessToken": token, "domain": self.domain}

    def _resources(self, tag: str) -> dict[str, int]:
        record = self.runtime.snapshot(tag)
        boot = (record.meta.get("boot") or {}) if record is not None else {}
        return {"cpuCount": int(boot.get("vcpus") or 1), "memoryMB": int(boot.get("memory_mib") or 0),
                "diskSizeMB": 0}

    @staticmethod
    def _labels(labels: Mapping[str, str]) -> dict[str, str]:
        """The labels an E2B user set: forkd's own (owner, nonce, workspace) are not theirs to see."""
        return {k: v for k, v in labels.items() if not reserved_label(k)}

    def _new_labels(self, principal: Principal, metadata: Mapping[str, str]) -> dict[str, str]:
        reserved = sorted(k for k in metadata if reserved_label(k))
        if reserved:
            raise E2BError(400, f"metadata keys {', '.join(reserved)} are reserved (\"workspace\" and \"forkd.*\"); "
                                "rename them")
        return {**metadata, OWNER_LABEL: principal.owner, NONCE_LABEL: secrets.token_hex(16)}

    def describe(self, resolved: Resolved, detail: bool = False) -> dict[str, Any]:
        """E2B's ``ListedSandbox`` (``SandboxDetail`` with ``detail``)."""
        if resolved.live is not None:
            record = resolved.live.record
            started, end_at = record.created_at, pause_at(resolved.labels) or record.end_at
            template, state = record.snapshot_tag, "running"
        else:
            workspace = resolved.workspace
            assert workspace is not None
            started, end_at = workspace.created_at, None
            template, state = workspace.meta.get("base_tag", workspace.snapshot_tag), "paused"
        if resolved.workspace is not None:
            started = resolved.workspace.created_at
            template = resolved.workspace.meta.get("base_tag", template)
        info = {"sandboxID": resolved.e2b_id, "templateID": template, "clientID": CLIENT_ID,
                "startedAt": rfc3339(started), "endAt": rfc3339(end_at if end_at is not None else started + MAX_TIMEOUT_S),
                "state": state, "envdVersion": ENVD_VERSION, "metadata": self._labels(resolved.labels),
                **self._resources(template)}
        if detail:
            info["envdAccessToken"] = self.credentials.access_token(resolved.e2b_id, resolved.nonce)
            info["domain"] = self.domain
            info["lifecycle"] = Policy.of(resolved.labels).describe()
        return info

    # lifecycle

    async def create(self, principal: Principal, template: str, timeout_s: int, metadata: dict[str, str],
                     envs: dict[str, str], public: bool = False, net: NetRequest | None = None,
                     policy: Policy = Policy()) -> dict[str, Any]:
        """A child of ``template``; one whose ``policy`` pauses at its timeout has no runtime deadline
        (the front's keeper pauses it: :meth:`pause_due`)."""
        record = self.runtime.snapshot(template)
        if record is None or not template_visible(record, principal) or template in self.storage.doomed:
            raise E2BError(404, f"template {template!r} not found: templates are forkd snapshots; list them with "
                                "GET /templates or `forkd snapshots`")
        labels = {**self._new_labels(principal, metadata), **({PUBLIC_LABEL: "true"} if public else {}),
                  **policy.labels(timeout_s)}
        options = ForkOptions(timeout_s=None if policy.pause else timeout_s, envs=envs, metadata=labels,
                              isolation=SandboxOptions(net=net or NetRequest()))
        (outcome,) = await self.runtime.spawner.fork(template, 1, options)
        if outcome.sandbox is None:
            raise lifecycle_error(outcome.error.kind, f"the sandbox did not start: {outcome.error}")
        return self.created(outcome.sandbox["id"], template, labels[NONCE_LABEL])

    def list(self, principal: Principal, metadata: dict[str, str], states: set[str]) -> list[dict[str, Any]]:
        found: list[Resolved] = []
        if "running" in states:
            for live in self.runtime.sandboxes.live():
                if live.record.status == "running" and not live.killing:
                    e2b_id = self.e2b_id(live)
                    workspace = self.runtime.workspaces.find(e2b_id) if e2b_id != live.record.id else None
                    found.append(Resolved(e2b_id, live, workspace))
        if "paused" in states:
            found += [Resolved(w.name, None, w) for w in self.runtime.workspaces.records() if w.state == "suspended"]
        described = [self.describe(r) for r in found if principal.sees(r.owner)]
        return [d for d in described if all(d["metadata"].get(k) == v for k, v in metadata.items())]

    async def set_timeout(self, principal: Principal, e2b_id: str, timeout_s: int, extend_only: bool = False,
                          resume: bool = False) -> None:
        """A new deadline; a paused sandbox is resumed first when it has ``autoResume`` (or ``resume``).
        A pause between the first look and the lifecycle lock makes it start over: as if this request
        came after the pause (a few times at most, then 409)."""
        for _ in range(3):
            resolved = self.resolve(e2b_id, principal)
            if resolved.live is None:
                if not (resume or Policy.of(resolved.labels).auto_resume):
                    raise E2BError(409, f"sandbox {e2b_id} is paused; resume it with Sandbox.connect() first")
                resolved = await self._resume(e2b_id, timeout_s)
            live = resolved.live
            assert live is not None
            pausing = Policy.of(resolved.labels).pause
            current = pause_at(resolved.labels) if pausing else live.record.end_at
            if extend_only and current is not None and current >= time.time() + timeout_s:
                return
            if not pausing:
                await self.runtime.sandboxes.set_timeout(live.record.id, timeout_s)
                return
            async with self.lock(e2b_id):
                now = self.resolve(e2b_id, principal)
                if now.live is not None:
                    await self._set_pause_at(now, timeout_s)
                    return
        raise E2BError(409, f"sandbox {e2b_id} was paused again while its timeout was set; try again")

    async def connect(self, principal: Principal, e2b_id: str, timeout_s: int) -> tuple[int, dict[str, Any]]:
        """Resume a paused sandbox (201) or extend a running one's deadline (200)."""
        resolved = self.resolve(e2b_id, principal)
        status = 200
        if resolved.live is None:
            await self._resume(e2b_id, timeout_s)
            status = 201
        await self.set_timeout(principal, e2b_id, timeout_s, extend_only=status == 200, resume=True)
        resolved = self.resolve(e2b_id, principal)
        return status, self.created(e2b_id, self.describe(resolved)["templateID"], resolved.nonce)

    async def kill(self, principal: Principal, e2b_id: str) -> None:
        """Kill it; a paused (or once paused) one's layers are left to the collector, which removes
        them when no snapshot of the sandbox was branched from them."""
        async with self.lock(e2b_id):
            resolved = self.resolve(e2b_id, principal)
            if resolved.workspace is not None:
                await self.storage.doom(list(resolved.workspace.meta.get("suspends", [])))
                await self.runtime.workspaces.remove(e2b_id, keep_layers=True)
            elif resolved.live is not None:
                try:
                    await self.runtime.sandboxes.kill(resolved.live.record.id)
                except SandboxNotFound:
                    raise E2BError(404, f"sandbox {e2b_id} was not found") from None
        self._forget(e2b_id)

    async def set_egress(self, principal: Principal, e2b_id: str, policy: EgressPolicy) -> None:
        live = self.resolve(e2b_id, principal).live
        if live is None:
            raise E2BError(409, f"sandbox {e2b_id} is paused; resume it with Sandbox.connect() first")
        try:
            await self.runtime.sandboxes.set_egress(live.record.id, policy)
        except NetworkModeConflict as exc:
            raise E2BError(409, f"{exc}: create it with allow_internet_access or a network option") from None

    async def rotate_token(self, principal: Principal, e2b_id: str) -> dict[str, Any]:
        """A new nonce, stored with the sandbox or paused workspace: its old token stops working."""
        async with self.lock(e2b_id):  # labels are replaced whole: no pause deadline written meanwhile
            resolved = self.resolve(e2b_id, principal)
            labels = {**resolved.labels, NONCE_LABEL: secrets.token_hex(16)}
            if resolved.workspace is not None:
                await self.runtime.workspaces.set_labels(e2b_id, labels)
            elif resolved.live is not None:
                await self.runtime.sandboxes.set_labels(resolved.live.record.id, labels)
        return self.created(e2b_id, self.describe(resolved)["templateID"], labels[NONCE_LABEL])

    async def pause(self, principal: Principal, e2b_id: str) -> None:
        """Pause it when the owner's quota and the disk's free-space floor allow (the keeper's pause at
        the timeout, :meth:`pause_due`, is held to the floor only: refusing it would lose the state)."""
        await self.storage.check(principal.owner, f"pausing {e2b_id}")
        async with self.lock(e2b_id):
            await self._pause(principal, e2b_id)

    async def _pause(self, principal: Principal | None, e2b_id: str) -> None:
        resolved = self.resolve(e2b_id, principal)
        if resolved.live is None:
            raise E2BError(409, f"sandbox {e2b_id} is already paused")
        if resolved.workspace is None:
            await self.runtime.workspaces.adopt(e2b_id, resolved.live.record.id)
        try:
            await self.runtime.workspaces.suspend(e2b_id)
        except (SnapshotConflict, SnapshotError) as exc:
            raise E2BError(409, f"sandbox {e2b_id} could not be paused: {exc}") from None
        # A pause past the chain's bound wrote a standalone layer: the ones below it are doomed (removed
        # once no snapshot of the sandbox was branched from them).
        replaced = [t for t in self.runtime.workspaces.unneeded(e2b_id) if t not in self.storage.doomed]
        if replaced:
            await self.storage.doom(replaced)

    async def fork(self, principal: Principal, e2b_id: str, count: int, timeout_s: int) -> list[dict[str, Any]]:
        """BRANCH the running sandbox (diff layer), then start ``count`` children of it; one result each.
        The snapshot and the children belong to the caller."""
        resolved = self.resolve(e2b_id, principal)
        live = resolved.live
        if live is None:
            raise E2BError(409, f"sandbox {e2b_id} is paused; resume it before forking")
        self.runtime.spawner.admit()  # a draining node refuses before the branch is written
        await self.storage.check(principal.owner, f"forking {e2b_id}")
        tag = fork_prefix(principal.owner) + secrets.token_hex(6)
        await self.runtime.branches.branch(live.record.id, tag, mode="diff", wait=True, meta={"e2b_sandbox": e2b_id})
        labels = self._new_labels(principal, self._labels(resolved.labels))
        options = ForkOptions(timeout_s=timeout_s, envs=live.record.meta.get("envs", {}), metadata=labels,
                              isolation=SandboxOptions(net=net_request_of(live.record.meta.get("net"))))
        outcomes = await self.runtime.spawner.fork(tag, count, options)
        return [{"sandbox": self.created(o.sandbox["id"], tag, labels[NONCE_LABEL])} if o.sandbox is not None
                else {"error": {"code": o.error.kind.status, "message": str(o.error)}} for o in outcomes]

    async def pause_due(self, now: float | None = None) -> list[str]:
        """The keeper's round: pause every running sandbox whose pausing timeout has passed; returns
        their E2B ids. One that cannot be paused (the disk is full) keeps running and is tried again."""
        now = time.time() if now is None else now
        due = [self.e2b_id(live) for live in self.runtime.sandboxes.live()
               if not live.killing and (pause_at(live.record.meta.get("metadata") or {}) or now + 1) <= now]
        paused = []
        for e2b_id in due:
            try:
                await self.storage.check(None, f"pausing {e2b_id} at its timeout")
                async with self.lock(e2b_id):
                    resolved = self.resolve(e2b_id)
                    when = pause_at(resolved.labels)
                    if resolved.live is None or when is None or when > now:
                        continue  # given a new timeout, or paused, meanwhile
                    await self._pause(None, e2b_id)
                paused.append(e2b_id)
            except Exception as exc:  # noqa: BLE001 - one sandbox never stops the round
                log.warning("sandbox %s reached its timeout but could not be paused (%s); it keeps running and "
                            "is tried again", e2b_id, exc)
        return paused

    def templates(self, principal: Principal) -> list[dict[str, Any]]:
        """E2B's ``Template`` for every ready forkd snapshot the caller may start sandboxes from (a
        snapshot its owner deleted is hidden at once, removed when nothing uses it)."""
        out = []
        for record in self.runtime.snapshot_records():
            if record.status != "ready" or not template_visible(record, principal) \
                    or record.tag in self.storage.doomed:
                continue
            when = rfc3339(record.created_at)
            out.append({"templateID": record.tag, "buildID": record.tag, "public": base_template(record),
                        "aliases": [record.tag],
                        "names": [record.tag], "createdAt": when, "updatedAt": when, "createdBy": None,
                        "lastSpawnedAt": None, "spawnCount": self.runtime.spawner.count_of(record.tag),
                        "buildCount": 1, "envdVersion": ENVD_VERSION, "buildStatus": "ready",
                        "machine": record.machine,  # forkd's own field: q35 or microvm
                        **self._resources(record.tag)})
        return out


def base_template(record: SnapshotRecord) -> bool:
    """A snapshot the operator made from an image (not a BRANCH, compaction or pause layer of some
    sandbox, which hold that sandbox's memory): every key may start sandboxes from it."""
    return record.parent_tag is None and not any(key in record.meta for key in _DERIVED_META)


def template_visible(record: SnapshotRecord, principal: Principal) -> bool:
    """Admin keys see every snapshot; other keys the base templates and their own snapshots and forks."""
    return principal.admin or base_template(record) or owned_by(record.tag, principal.owner)


def _plausible(name: str) -> bool:
    return 0 < len(name) <= 64 and all(c.isalnum() or c in "-_" for c in name)
