"""``NodeAgent``: the one long-lived Ray actor per forkd node, speaking to that node's daemon.

It is placed with hard node affinity (it never runs anywhere but its node) and restarted by Ray when
its process dies; its node's daemon is found through the environment Ray gave the node's workers
(``FORKD_URL``, ``FORKD_TOKEN``: set by ``forkd node start`` or the node's pod spec). It runs the
cluster's work where the sandboxes are: an item of ``Cluster.map`` forks its sandbox on this node,
runs the caller's function against the SDK's ``Sandbox`` and kills the sandbox. A thread reaps the
children of drivers whose Ray job has died (their owner label names the job).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import ray

from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.controller import Controller
from forkd.sdk.errors import DaemonUnreachable, ForkdError
from forkd.sdk.sandbox_sync import Sandbox

log = logging.getLogger("forkd.cluster")

OWNER_PREFIX = "ray-job-"  # owner labels the cluster gives its children: "ray-job-<job id hex>"
REAP_PERIOD_S = 15.0


def owner_of(job_id: str) -> str:
    return f"{OWNER_PREFIX}{job_id}"


def dead_jobs() -> set[str]:
    """The ids (hex) of the Ray jobs the GCS has marked dead: drivers that can no longer kill their children.

    Read from Ray's private job table (``ray._private.state.jobs()``, the GCS's own, the one place
    forkd uses a private Ray API): Ray's public ways to list jobs, ``ray.util.state.list_jobs`` and
    ``JobSubmissionClient``, ask the dashboard's HTTP server, which a head may run without
    (``--include-dashboard=false``, and the ``ray`` extra without ``[default]`` has none), and the
    latter lists only submitted jobs, not drivers. ``ray`` is pinned in pyproject; a Ray that moves or
    reshapes the table fails here with what changed, and in tests/unit/test_cluster.py, which checks
    this against a head run without the dashboard.
    """
    table = ray._private.state.jobs()  # noqa: SLF001 - no public job table without the dashboard (above)
    try:
        return {str(job["JobID"]) for job in table if job["IsDead"]}
    except (KeyError, TypeError) as exc:
        raise RuntimeError(f"Ray {ray.__version__}'s job table changed shape ({exc!r}); "
                           "forkd.cluster.actor.dead_jobs reads its JobID and IsDead fields to find dead drivers: "
                           "install the Ray version pyproject pins") from exc


class NodeAgent:
    """Wraps this Ray node's daemon; every method is a call the driver makes on the node."""

    def __init__(self, reap_period_s: float = REAP_PERIOD_S) -> None:
        self.connection = ConnectionConfig.from_env()
        if self.connection.socket is not None:
            raise RuntimeError("this Ray node's FORKD_URL is a Unix socket: peers cannot pull from it; "
                               "start the node with `forkd node start` (it serves the daemon on TCP)")
        self.controller = Controller(connection=self.connection)
        self._stop = threading.Event()
        threading.Thread(target=self._reap_forever, args=(reap_period_s,), name="forkd-reaper", daemon=True).start()

    def describe(self) -> dict[str, Any]:
        """Where the daemon (and its E2B front, if any) listens and its ``/v1/node`` answer (the
        directory's entry for this node)."""
        return {"ray_node_id": ray.get_runtime_context().get_node_id(), "url": self.connection.url,
                "token": self.connection.token, "pid": os.getpid(), "node": self.controller.node(),
                "e2b_url": os.environ.get("FORKD_E2B_URL")}

    def pull(self, digest: str, source: str, source_token: str | None) -> dict[str, Any]:
        return self.controller.node_pull(digest, source, source_token)  # type: ignore[no-any-return]

    def fork(self, digest: str, n: int, key: str, owner: str, timeout_s: float | None) -> list[str]:
        """Fork ``n`` children; a transport failure is retried once with the same key (never more children).
        Raises when none started; fewer than ``n`` is the caller's to count."""
        def once() -> dict[str, Any]:
            answer: dict[str, Any] = self.controller.fork(None, n, snapshot_digest=digest, idempotency_key=key,
                                                          owner=owner, timeout_s=timeout_s)
            return answer
        try:
            answer = once()
        except DaemonUnreachable:
            answer = once()
        children = [str(child["id"]) for child in answer["sandboxes"]]
        if not children:
            raise ForkdError(500, "fork_failed", "; ".join(map(str, answer.get("errors", [])))
                             or f"the daemon at {self.connection.url} started no sandbox of {digest[:12]}")
        return children

    def run(self, digest: str, key: str, owner: str, fn: Callable[[Sandbox, Any], Any], item: Any,
            timeout_s: float | None) -> dict[str, Any]:
        """One item of a map: a fresh sandbox of ``digest``, ``fn(sandbox, item)``, the sandbox killed.

        A fork this node refuses (full, snapshot gone) answers ``{"refused": why}`` so the driver places
        the item elsewhere; what ``fn`` raises is the item's own error and propagates."""
        try:
            sandbox = self._start(digest, key, owner, timeout_s)
        except ForkdError as exc:
            return {"refused": f"{exc.code}: {exc.message}"}
        try:
            return {"value": fn(sandbox, item), "sandbox_id": sandbox.sandbox_id}
        finally:
            with contextlib.suppress(ForkdError):
                sandbox.kill()
            sandbox.close()

    def _start(self, digest: str, key: str, owner: str, timeout_s: float | None) -> Sandbox:
        (sandbox_id,) = self.fork(digest, 1, key, owner, timeout_s)
        try:
            return Sandbox.connect(sandbox_id, connection=self.connection)
        except BaseException:
            with contextlib.suppress(ForkdError):
                self.controller.kill(sandbox_id)
            raise

    def kill_owner(self, owner: str) -> list[str]:
        return list(self.controller.kill_owner(owner))

    def pid(self) -> int:
        return os.getpid()

    def reap_dead_drivers(self) -> list[str]:
        """Kill the children of every driver whose Ray job is dead (it can no longer kill them itself)."""
        dead = {owner_of(job) for job in dead_jobs()}
        owners = {str(s.get("owner")) for s in self.controller.sandboxes()} & dead
        return [child for owner in sorted(owners) for child in self.kill_owner(owner)]

    def _reap_forever(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                if killed := self.reap_dead_drivers():
                    log.info("reaped %d children of drivers that died", len(killed))
            except Exception:  # noqa: BLE001 - the reaper must outlive a daemon restart or a GCS hiccup
                log.exception("reaping the children of dead drivers failed; retrying in %.0f s", period_s)
