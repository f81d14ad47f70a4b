"""What a remote driver (a cluster scheduler, an evaluation harness) needs of forks: a retried fork is
answered the same and never makes more children, and a driver's children are reaped together.

A fork made with an idempotency key runs in a task of its own, so it finishes and its answer is
kept even when the client that asked leaves (a retry after a timeout is the usual reason for a key).
The answer and a fingerprint of the request are kept in the registry (``fork_keys``) for
``KEEP_S``, across daemon restarts, at most ``MAX_KEPT`` of them (the oldest are forgotten first: a
retry of a forgotten key forks again). A duplicate that arrives while the first still runs waits
for it. The same key with another request is refused (``IdempotencyConflict``). A fork whose request
failed as a whole (an unknown snapshot) keeps no answer: its retry runs again.

A keyed fork nobody waits for is bounded: once its last client left, a client has ``ABANDON_S`` to
come back for it (a retry with the key joins it, or takes its answer). After that it is given up:
children still starting are refused (woken if they wait for a restore slot) or killed once they
answer, those that answered are killed, and no answer is kept, so a later retry forks again, as if
the first had never been asked. A driver that asked once therefore ends with the children of one
answer it received, or with none; never with children it was never told of.

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
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from forkd.runtime.sandboxes import SandboxNotFound, SandboxService
from forkd.runtime.spawning import ForkHandle, Spawner
from forkd.store.registry import Registry

KEEP_S = 24 * 3600.0  # how long a key's answer is kept
MAX_KEPT = 10_000  # keys whose answers are kept at most; the oldest are forgotten first
ABANDON_S = 60.0  # how long a keyed fork waits for a client to come back once its last one left

log = logging.getLogger("forkd.driver_forks")

Fork = Callable[[ForkHandle], Awaitable[dict[str, Any]]]  # the fork itself, its children joining the handle


class IdempotencyConflict(RuntimeError):
    """An idempotency key was reused with a different request (HTTP 409 ``idempotency_conflict``)."""

    kind = "idempotency_conflict"


class ForkAbandoned(RuntimeError):
    """A keyed fork nobody came back for was given up. Its task ends with this; a client that joined it
    in that moment forks again instead, so no client is answered with it."""


def fingerprint(request: dict[str, Any]) -> str:
    """A digest of what a fork asks for (canonical JSON), to tell a retry from a different request."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(eq=False)
class _Keyed:
    """One keyed fork in this daemon, from its first request until a client took its answer or it was
    given up."""

    fingerprint: str
    handle: ForkHandle = field(default_factory=ForkHandle)
    task: asyncio.Task[dict[str, Any]] | None = None
    waiters: int = 0  # clients waiting for it now
    forked: bool = False  # it made children (rather than recalling a kept answer)
    clock: asyncio.TimerHandle | None = None  # runs while nobody waits: at its end the fork is given up


class DriverForks:
    def __init__(self, registry: Registry, sandboxes: SandboxService, spawner: Spawner, keep_s: float = KEEP_S,
                 max_kept: int = MAX_KEPT, abandon_s: float = ABANDON_S) -> None:
        self.registry = registry
        self.sandboxes = sandboxes
        self.spawner = spawner
        self.keep_s = keep_s
        self.max_kept = max_kept
        self.abandon_s = abandon_s
        self._keyed: dict[str, _Keyed] = {}  # running, or answered and not yet taken by a client

    async def once(self, key: str, request_fingerprint: str, fork: Fork) -> dict[str, Any]:
        """The answer of the fork made with ``key``: ``fork()``'s the first time, the kept one after."""
        while (keyed := self._keyed.get(key)) is not None:
            _check(key, keyed.fingerprint, request_fingerprint)
            with contextlib.suppress(Exception):  # the first failed as a whole, or was given up: run it again
                return await self._wait(key, keyed)
        keyed = _Keyed(request_fingerprint)
        keyed.task = asyncio.get_running_loop().create_task(self._first(key, keyed, fork))
        self._keyed[key] = keyed
        keyed.task.add_done_callback(lambda task: self._ended(key, keyed, task))
        return await self._wait(key, keyed)

    async def _wait(self, key: str, keyed: _Keyed) -> dict[str, Any]:
        """Wait for the fork's answer; a client leaving does not stop it, the last one starts its clock."""
        assert keyed.task is not None
        keyed.waiters += 1
        self._stop_clock(keyed)
        try:
            answer = await asyncio.shield(keyed.task)
        except BaseException:
            keyed.waiters -= 1
            if keyed.waiters == 0 and not keyed.task.done():
                self._start_clock(key, keyed)
            raise
        keyed.waiters -= 1
        self._forget(key, keyed)  # a client has it: nothing of it is given up now
        return answer

    async def _first(self, key: str, keyed: _Keyed, fork: Fork) -> dict[str, Any]:
        now = time.time()
        kept = await asyncio.to_thread(self.registry.recall_fork, key, now - self.keep_s)
        if kept is not None:
            _check(key, kept[0], keyed.fingerprint)
            return kept[1]
        if keyed.handle.why is not None:  # given up while it looked for a kept answer
            raise ForkAbandoned(f"the fork with idempotency key {key!r} was {keyed.handle.why}; fork again")
        keyed.forked = True
        answer = await fork(keyed.handle)
        if keyed.handle.why is not None:  # given up while it ran: what it started must not outlive it
            await self._kill(keyed.handle.answered)
            raise ForkAbandoned(f"the fork with idempotency key {key!r} was {keyed.handle.why}; fork again")
        await asyncio.to_thread(self.registry.remember_fork, key, keyed.fingerprint, answer, time.time(),
                                time.time() - self.keep_s, self.max_kept)
        return answer

    def _ended(self, key: str, keyed: _Keyed, task: asyncio.Task[dict[str, Any]]) -> None:
        """The fork's task ended: a failure is forgotten (its retry runs again); an answer nobody waited
        for waits ``abandon_s`` for a client to take it."""
        if task.cancelled() or task.exception() is not None:  # the exception is its waiters' (retrieved here)
            self._forget(key, keyed)
        elif keyed.waiters == 0:
            self._start_clock(key, keyed)

    def _start_clock(self, key: str, keyed: _Keyed) -> None:
        self._stop_clock(keyed)
        keyed.clock = asyncio.get_running_loop().call_later(self.abandon_s, self._give_up, key, keyed)

    @staticmethod
    def _stop_clock(keyed: _Keyed) -> None:
        if keyed.clock is not None:
            keyed.clock.cancel()
            keyed.clock = None

    def _give_up(self, key: str, keyed: _Keyed) -> None:
        """No client came back within ``abandon_s``: stop the fork, or undo the answer nobody took."""
        keyed.clock = None
        if self._keyed.get(key) is not keyed or keyed.waiters:  # a client took it meanwhile
            return
        why = f"given up: no client waited for it for {self.abandon_s:.0f} s"
        assert keyed.task is not None
        if not keyed.task.done():
            log.info("fork with idempotency key %r %s; stopping its children", key, why)
            keyed.handle.stop(why)
            return
        if not keyed.forked:  # it only recalled an answer taken before: nothing of it is this task's
            self._forget(key, keyed)
            return
        log.info("fork with idempotency key %r was %s after it answered; killing its %d children", key, why,
                 len(keyed.handle.answered))
        keyed.handle.why = why
        keyed.task = asyncio.get_running_loop().create_task(self._undo(key, keyed))  # a retry meanwhile waits
        keyed.task.add_done_callback(lambda task: self._ended(key, keyed, task))

    async def _undo(self, key: str, keyed: _Keyed) -> dict[str, Any]:
        """Forget the key (first: a retry must never be told of children being killed), then kill them."""
        await asyncio.to_thread(self.registry.forget_fork, key)
        await self._kill(keyed.handle.answered)
        raise ForkAbandoned(f"the fork with idempotency key {key!r} was {keyed.handle.why}; fork again")

    def _forget(self, key: str, keyed: _Keyed) -> None:
        self._stop_clock(keyed)
        if self._keyed.get(key) is keyed:
            del self._keyed[key]

    async def _kill(self, sandbox_ids: list[str]) -> None:
        results = await asyncio.gather(*(self.sandboxes.kill(i) for i in sandbox_ids), return_exceptions=True)
        for sandbox_id, result in zip(sandbox_ids, results):
            if isinstance(result, Exception) and not isinstance(result, SandboxNotFound):
                log.warning("killing child %s of a given-up fork failed: %s", sandbox_id, result)

    def owned(self, owner: str) -> list[dict[str, Any]]:
        return [self.sandboxes.describe(s) for s in self.sandboxes.live() if s.record.owner == owner]

    async def kill_owned(self, owner: str) -> list[str]:
        """Kill every child of ``owner`` (the reaper of a driver that died); returns the ids of those killed.

        Its children still starting are stopped too: refused before their restore (at once if they wait
        for a restore slot), or killed once they answer (so this waits for them, at most a restore's
        answer timeout); those that had an id are listed.
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
