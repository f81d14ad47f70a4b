"""What a starting daemon does about what the previous one left: re-adopt live sandboxes, reap the rest.

A daemon may die at any point (``kill -9``, OOM, an upgrade). Its VMMs keep running: they are in
their own session and write only to files. On start, every sandbox record whose VMM is still the
process it started (same pid *and* start time, command line naming its run directory) and whose
monitor and guest agent answer is served again, watched like a fresh child. Everything else is
reaped: a VMM that does not answer, a child caught halfway through its restore, a record whose VMM
is gone, a run directory without a record, the parent and build directory of a snapshot that was
being baked. Reaping goes through :meth:`SandboxService.release`, so every plugged-in releaser
(network namespace, cgroup, ...) runs for each id, whatever state it was left in.

A live sandbox's guest is stopped inside a BRANCH's pause (``runtime/branches.py``) or for being
idle (``runtime/idle.py``). So a sandbox is adopted even when its VMM is stopped and is resumed
(``cont``) before it must answer, then its clock is set: a daemon killed inside a branch's pause
loses the branch (the store's reaper marks the snapshot ``failed``), never the user's sandbox. A
branch registers its snapshot as ``writing``, naming its source sandbox, before it stops the
source; such a sandbox keeps running but is listed in ``Recovery.resumed``: its disk may hold a
layer no snapshot received, so the runtime refuses to branch it again.

Recovery runs before the daemon serves, so no record may stop it: a VMM that fails its adoption in
any way is reaped like one that does not answer, and a record whose reaping itself fails is logged
and left (``failed``) for the next start to try again, while every other record is recovered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

from forkd.guest import protocol
from forkd.runtime.agent_client import connect_when_answering
from forkd.runtime.idle import correct_clock
from forkd.store.registry import SandboxRecord
from forkd.runtime.sandboxes import SandboxService
from forkd.store.io import blocking
from forkd.store.layout import BUILD_PREFIX
from forkd.store.snapshots import SnapshotStore
from forkd.validation import is_sandbox_id
from forkd.vmm.process import AdoptedProcess, ProcessRef, kill_pidfd, open_verified, processes_under

ADOPT_ANSWER_TIMEOUT_S = 10.0
KILL_TIMEOUT_S = 10.0
log = logging.getLogger("forkd.recovery")


@dataclass
class Recovery:
    adopted: list[str] = field(default_factory=list)
    reaped: list[str] = field(default_factory=list)  # sandbox ids: records and record-less directories
    failed: list[str] = field(default_factory=list)  # records whose reaping failed: left for the next start
    resumed: dict[str, str] = field(default_factory=dict)  # adopted sources of interrupted branches: id → tag
    removed_builds: list[str] = field(default_factory=list)  # half-built snapshot directories


async def recover(sandboxes: SandboxService, store: SnapshotStore) -> Recovery:
    """Re-adopt or reap every sandbox a previous daemon left, then remove what has no record."""
    paths, program = sandboxes.paths, sandboxes.vmm.program
    result = Recovery()
    vmms: dict[str, list[ProcessRef]] = defaultdict(list)
    for ref in processes_under(paths.sandboxes, program):
        vmms[ref.directory].append(ref)
    records = sandboxes.registry.list_sandboxes()  # the daemon serves nothing yet
    branching = _branch_sources(store)
    outcomes = await asyncio.gather(*(_recover_one(sandboxes, r, vmms.pop(r.run_dir.name, []), r.id in branching)
                                      for r in records), return_exceptions=True)
    for record, adopted in zip(records, outcomes):
        if isinstance(adopted, BaseException):
            log.error("recovering sandbox %s failed (%r); the next start tries again", record.id, adopted)
            result.failed.append(record.id)
        else:
            (result.adopted if adopted else result.reaped).append(record.id)
            if adopted and record.id in branching:
                result.resumed[record.id] = branching[record.id]
    known = {r.run_dir.name for r in records}
    if paths.sandboxes.exists():
        for leftover in sorted(paths.sandboxes.iterdir()):
            if leftover.name not in known and leftover.is_dir() and is_sandbox_id(leftover.name):
                await _reap(result, leftover.name, _reap_directory(sandboxes, leftover, vmms.pop(leftover.name, [])))
    for name, refs in vmms.items():  # VMMs whose directory is gone altogether
        await _kill_all(refs, f"{paths.sandboxes}/{name}/")
    for orphan in sorted(set(sandboxes.registry.leases()) - set(result.adopted) - set(result.failed)):
        await _reap(result, orphan, asyncio.to_thread(sandboxes.isolation.release, orphan))  # a lease without a record
    result.removed_builds = await _remove_half_built(sandboxes, store)
    return result


def _branch_sources(store: SnapshotStore) -> dict[str, str]:
    """Sandboxes a dead daemon was branching (their guest may be stopped): id → the branch's tag."""
    return {str(r.meta["source_sandbox"]): r.tag for r in store.registry.list_snapshots()
            if r.status == "writing" and isinstance(r.meta.get("source_sandbox"), str)}


async def _recover_one(sandboxes: SandboxService, record: SandboxRecord, refs: list[ProcessRef],
                       branching: bool) -> bool:
    """Serve ``record`` again if its VMM and agent answer; otherwise kill its VMM and release it.
    ``branching``: a branch of it was being written, so its guest may be stopped: resume it."""
    if record.status == "running" and record.pid and record.vmm_state:
        pidfd = open_verified(record.pid, record.vmm_started, f"{record.run_dir}/")
        if pidfd is not None:
            process = AdoptedProcess(record.pid, pidfd)
            try:
                vm = await sandboxes.vmm.adopt(record.id, process, record.run_dir, record.vmm_state,
                                               stopped_ok=True)
                await sandboxes.vmm.resume(vm)  # `cont` of a running guest changes nothing
                if branching:
                    log.warning("sandbox %s was being branched when the daemon stopped; it runs again", record.id)
                agent, _ = await connect_when_answering(vm, ADOPT_ANSWER_TIMEOUT_S, protocol.OP_PING)
                await correct_clock(agent)  # it may have been stopped (idle, or in a branch's pause) for long
            except Exception as exc:  # VmmError, AgentError, or anything else: it cannot be served
                log.warning("sandbox %s does not answer (%s); reaping it", record.id, exc)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await asyncio.wait_for(process.wait(), KILL_TIMEOUT_S)
            else:
                record.readopted_at = time.time()
                await asyncio.to_thread(sandboxes.registry.set_readopted, record.id, record.readopted_at)
                sandboxes.watch(record, vm, agent)
                return True
    await _kill_all(refs, f"{record.run_dir}/")
    await sandboxes.release(record.id, record.run_dir)
    return False


async def _reap(result: Recovery, name: str, work: Awaitable[object]) -> None:
    """Reap one leftover; a failure is logged and left for the next start, it never stops recovery."""
    try:
        await work
    except Exception as exc:
        log.error("reaping %s failed (%r); the next start tries again", name, exc)
        result.failed.append(name)
    else:
        result.reaped.append(name)


async def _reap_directory(sandboxes: SandboxService, run_dir: Path, refs: list[ProcessRef]) -> None:
    """A run directory without a record: its VMMs killed, everything it held released."""
    await _kill_all(refs, f"{run_dir}/")
    await sandboxes.release(run_dir.name, run_dir)


async def _kill_all(refs: list[ProcessRef], must_mention: str) -> None:
    for ref in refs:
        pidfd = open_verified(ref.pid, ref.started, must_mention)
        if pidfd is not None:
            if not await asyncio.to_thread(kill_pidfd, pidfd, KILL_TIMEOUT_S):
                log.error("VMM %d of %s did not exit after SIGKILL", ref.pid, must_mention)


async def _remove_half_built(sandboxes: SandboxService, store: SnapshotStore) -> list[str]:
    """Kill parents of snapshots that were being baked, then let the store reap what they and any
    other interrupted build left (see :meth:`SnapshotStore.reap`)."""
    snapshots_dir = store.directory
    for ref in processes_under(snapshots_dir, sandboxes.vmm.program):
        if ref.directory.startswith(BUILD_PREFIX):
            await _kill_all([ref], f"{snapshots_dir}/{ref.directory}/")
    return await blocking(store.reap)
