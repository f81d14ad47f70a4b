"""Sandboxes: fork children of a snapshot, list, describe, kill, set their timeout, ping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from forkd.daemon import schemas
from forkd.daemon.deps import RuntimeDep, SandboxId
from forkd.daemon.errors import unless_client_leaves
from forkd.daemon.ndjson import NDJSON, NDJSONResponse, detached
from forkd.host.cgroups import Limits
from forkd.host.netpolicy import NetRequest, allow_rule, egress_policy
from forkd.runtime.driver_forks import fingerprint
from forkd.runtime.isolation import SandboxOptions
from forkd.runtime.spawning import ForkHandle, ForkOptions, ForkOutcome

router = APIRouter()
OwnerQuery = Annotated[str | None, Query(pattern=schemas.LABEL_PATTERN, description="only this owner's children")]


def isolation_of(body: schemas.SandboxCreate) -> SandboxOptions:
    egress = body.egress or schemas.EgressBody()
    policy = egress_policy(egress.default, [allow_rule(r.cidr, list(r.ports), r.protocol) for r in egress.allow],
                           egress.dns)
    return SandboxOptions(net=NetRequest(mode=body.net, egress=policy),
                          limits=Limits(memory_limit_mib=body.memory_limit_mib, cpu_quota=body.cpu_quota,
                                        cpu_weight=body.cpu_weight, pids_max=body.pids_max))


MAYBE_FORK_STREAM: dict[int | str, dict[str, Any]] = {
    201: {"model": schemas.ForkResult, "description": "every child's sandbox or error"},
    200: {"content": {NDJSON: {"schema": {"type": "string", "description": (
        "with \"stream\": true, one {\"child\": {index, sandbox | error: {code, message}, timings}} line per "
        "child as it answers or fails, then {\"result\": ForkResult}")}}}, "description": "NDJSON, with \"stream\": true"}}


def fork_answer(outcomes: list[ForkOutcome]) -> dict[str, Any]:
    return {"sandboxes": [o.sandbox for o in outcomes if o.sandbox is not None],
            "errors": [{"index": o.index, **o.error.as_dict()} for o in outcomes if o.error is not None]}


def child_line(outcome: ForkOutcome) -> dict[str, Any]:
    """One child of a streamed fork, as soon as it answered or failed."""
    line: dict[str, Any] = {"index": outcome.index, "timings": outcome.timings}
    if outcome.sandbox is not None:
        line["sandbox"] = outcome.sandbox
    elif outcome.error is not None:
        line["error"] = outcome.error.as_dict()
    return line


@router.post("/v1/sandboxes", status_code=201, response_model=None, responses=MAYBE_FORK_STREAM)
async def fork(body: schemas.SandboxCreate, runtime: RuntimeDep, request: Request) -> dict[str, Any] | NDJSONResponse:
    options = ForkOptions(timeout_s=body.timeout_s, envs=body.envs, metadata=body.metadata,
                          isolation=isolation_of(body), deadline_s=body.deadline_s, owner=body.owner)

    async def snapshot() -> str:
        if body.snapshot_tag is not None:
            return body.snapshot_tag
        return (await runtime.snapshot_by_digest(body.snapshot_digest)).tag  # type: ignore[arg-type]

    async def answer(handle: ForkHandle | None = None) -> dict[str, Any]:  # a retried keyed fork: no snapshot looked up
        return fork_answer(await runtime.spawner.fork(await snapshot(), body.n, options, handle))

    if body.idempotency_key is not None:
        # the fork outlives a client that leaves, for ABANDON_S: a retry with the key takes its answer
        keyed = runtime.driver_forks.once(body.idempotency_key, fingerprint(body.model_dump(exclude={
            "idempotency_key", "stream"})), answer)
        return await unless_client_leaves(request, keyed)
    if not body.stream:
        return await answer()
    # A tag that cannot be forked is an error status here, before any line is streamed.
    children = await runtime.spawner.start_fork(await snapshot(), body.n, options)

    async def work(emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        outcomes = []
        async for outcome in children:  # children finish starting even if the client left
            outcomes.append(outcome)
            emit({"child": child_line(outcome)})
        return fork_answer(sorted(outcomes, key=lambda o: o.index))

    return detached(work)


@router.get("/v1/sandboxes", response_model=schemas.SandboxList)
async def list_sandboxes(runtime: RuntimeDep, owner: OwnerQuery = None) -> dict[str, Any]:
    if owner is not None:
        return {"sandboxes": runtime.driver_forks.owned(owner)}
    return {"sandboxes": [runtime.sandboxes.describe(s) for s in runtime.sandboxes.live()]}


@router.delete("/v1/sandboxes", response_model=schemas.KilledList)
async def kill_owned(runtime: RuntimeDep, owner: Annotated[str, Query(pattern=schemas.LABEL_PATTERN)]) -> dict[str, Any]:
    """Kill every child of ``owner`` (the reaper of a driver that died)."""
    return {"killed": await runtime.driver_forks.kill_owned(owner)}


@router.get("/v1/sandboxes/{sandbox_id}", response_model=schemas.Sandbox)
async def get_sandbox(sandbox_id: SandboxId, runtime: RuntimeDep) -> dict[str, Any]:
    return runtime.sandboxes.lookup(sandbox_id)


@router.delete("/v1/sandboxes/{sandbox_id}")
async def kill_sandbox(sandbox_id: SandboxId, runtime: RuntimeDep) -> dict[str, Any]:
    await runtime.sandboxes.kill(sandbox_id)
    return {"killed": sandbox_id}


@router.post("/v1/sandboxes/{sandbox_id}/timeout")
async def set_timeout(sandbox_id: SandboxId, body: schemas.TimeoutBody, runtime: RuntimeDep) -> dict[str, Any]:
    return {"id": sandbox_id, "end_at": await runtime.sandboxes.set_timeout(sandbox_id, body.timeout_s)}


@router.post("/v1/sandboxes/{sandbox_id}/ping")
async def ping(sandbox_id: SandboxId, runtime: RuntimeDep) -> dict[str, Any]:
    return await runtime.sessions.ping(sandbox_id)
