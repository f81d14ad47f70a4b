"""What a remote driver (a cluster scheduler, an evaluation harness) needs of forks: a retried fork is
answered the same and never makes more children, and a driver's children are reaped together.

A fork made with an idempotency key runs in a task of its own, so it finishes and its answer is
kept even when the client that asked leaves (a retry after a timeout is the usual reason for a key).
The answer and a fingerprint of the request are kept in the registry (``fork_keys``) for
``KEEP_S``, across daemon restarts; a duplicate that arrives while the first still runs waits for
it. The same key with another request is refused (``IdempotencyConflict``). A fork whose request
failed as a whole (an unknown snapshot) keeps no answer: its retry runs again.

``DELETE /v1/sandboxes?owner=`` also stops the owner's children still starting (the spawner refuses
them before their restore or kills them once they answer) and answers once they are gone, so a
dead driver's reaper leaves nothing behind. A fork of that owner that arrives after it is not stopped.

Not covered: a daemon that dies while a keyed fork runs keeps no answer, so that fork's retry
forks again (its first children died with the daemon unless ``keep_sandboxes_on_stop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from forkd.runtime.sandboxes import SandboxNotFound, SandboxService
from forkd.runtime.spawning import Spawner
from forkd.store.registry import Registry

KEEP_S = 24 * 3600.0  # how long a key's answer is kept


class IdempotencyConflict(RuntimeError):
    """An idempotency key was reused with a different request (HTTP 409 ``idempotency_conflict``)."""

    kind = "idempotency_conflict"


def fingerprint(request: dict[str, Any]) -> str:
    """A digest of what a fork asks for (canonical JSON), to tell a retry from a different request."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class DriverForks:
    def __init__(self, registry: Registry, sandboxes: SandboxService, spawner: Spawner,
                 keep_s: float = KEEP_S) -> None:
        self.registry = registry
        self.sandboxes = sandboxes
        self.spawner = spawner
        self.keep_s = keep_s
        self._running: dict[str, tuple[str, asyncio.Task[dict[str, Any]]]] = {}  # key -> (fingerprint, fork)

    async def once(self, key: str, request_fingerprint: str,
                   fork: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """The answer of the fork made with ``key``: ``fork()``'s the first time, the kept one after."""
        while (running := self._running.get(key)) is not None:
            _check(key, running[0], request_fingerprint)
            with contextlib.suppress(Exception):  # the first failed as a whole: this one runs it again
                return await asyncio.shield(running[1])
        task = asyncio.get_running_loop().create_task(self._first(key, request_fingerprint, fork))
        self._running[key] = (request_fingerprint, task)
        task.add_done_callback(lambda _: self._running.pop(key, None))
        return await asyncio.shield(task)  # a client leaving does not stop the fork or lose its answer

    async def _first(self, key: str, request_fingerprint: str,
                     fork: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        now = time.time()
        kept = await asyncio.to_thread(self.registry.recall_fork, key, now - self.keep_s)
        if kept is not None:
            _check(key, kept[0], request_fingerprint)
            return kept[1]
        answer = await fork()
        await asyncio.to_thread(self.registry.remember_fork, key, request_fingerprint, answer, time.time(),
                                time.time() - self.keep_s)
        return answer

    def owned(self, owner: str) -> list[dict[str, Any]]:
        return [self.sandboxes.describe(s) for s in self.sandboxes.live() if s.record.owner == owner]

    async def kill_owned(self, owner: str) -> list[str]:
        """Kill every child of ``owner`` (the reaper of a driver that died); returns the ids of those killed.

        Its children still starting are stopped too: refused before their restore, or killed once they
        answer (so this waits for them, at most a restore's answer timeout); those that had an id are listed.
        """
        starting = self.spawner.reap(owner)  # no await between these two: every child is in one of them
        doomed = [s.record.id for s in self.sandboxes.live() if s.record.owner == owner]
        results = await asyncio.gather(*(self.sandboxes.kill(i) for i in doomed),
                                       *(child.done.wait() for child in starting), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException) and not isinstance(r, SandboxNotFound)),
                      None)
        if failed is not None:  # the others were still killed
            raise failed
        stopped = [c.sandbox_id for c in starting if c.stopped and c.sandbox_id is not None]
        return [i for i, result in zip(doomed, results) if result is None] + stopped


def _check(key: str, kept: str, asked: str) -> None:
    if kept != asked:
        raise IdempotencyConflict(f"idempotency key {key!r} was used by a different fork request; send the same "
                                  "request to get its answer again, or use a new key for a new fork")
