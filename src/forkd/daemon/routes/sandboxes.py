"""Sandboxes: fork children of a snapshot, list, describe, kill, set their timeout, ping."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from forkd.daemon import schemas
from forkd.daemon.deps import RuntimeDep, SandboxId
from forkd.host.cgroups import Limits
from forkd.host.netpolicy import NetRequest, allow_rule, egress_policy
from forkd.runtime.isolation import SandboxOptions
from forkd.runtime.sandboxes import ForkOptions

router = APIRouter()


def isolation_of(body: schemas.SandboxCreate) -> SandboxOptions:
    egress = body.egress or schemas.EgressBody()
    policy = egress_policy(egress.default, [allow_rule(r.cidr, list(r.ports), r.protocol) for r in egress.allow],
                           egress.dns)
    return SandboxOptions(net=NetRequest(mode=body.net, egress=policy),
                          limits=Limits(memory_limit_mib=body.memory_limit_mib, cpu_quota=body.cpu_quota,
                                        cpu_weight=body.cpu_weight, pids_max=body.pids_max))


@router.post("/v1/sandboxes", status_code=201, response_model=schemas.ForkResult)
async def fork(body: schemas.SandboxCreate, runtime: RuntimeDep) -> dict[str, Any]:
    options = ForkOptions(timeout_s=body.timeout_s, envs=body.envs, metadata=body.metadata, isolation=isolation_of(body))
    outcomes = await runtime.sandboxes.fork(body.snapshot_tag, body.n, options)
    return {
        "sandboxes": [o.sandbox for o in outcomes if o.sandbox is not None],
        "errors": [o.error for o in outcomes if o.error is not None],
    }


@router.get("/v1/sandboxes", response_model=schemas.SandboxList)
async def list_sandboxes(runtime: RuntimeDep) -> dict[str, Any]:
    return {"sandboxes": [runtime.sandboxes.describe(s) for s in runtime.sandboxes.live()]}


@router.get("/v1/sandboxes/{sandbox_id}", response_model=schemas.Sandbox)
async def get_sandbox(sandbox_id: SandboxId, runtime: RuntimeDep) -> dict[str, Any]:
    return runtime.sandboxes.lookup(sandbox_id)


@router.delete("/v1/sandboxes/{sandbox_id}")
async def kill_sandbox(sandbox_id: SandboxId, runtime: RuntimeDep) -> dict[str, Any]:
    await runtime.sandboxes.kill(sandbox_id)
    return {"killed": sandbox_id}


@router.post("/v1/sandboxes/{sandbox_id}/timeout")
async def set_timeout(sandbox_id: SandboxId, body: schemas.TimeoutBody, runtime: RuntimeDep) -> dict[str, Any]:
    return {"id": sandbox_id, "end_at": runtime.sandboxes.set_timeout(sandbox_id, body.timeout_s)}


@router.post("/v1/sandboxes/{sandbox_id}/ping")
async def ping(sandbox_id: SandboxId, runtime: RuntimeDep) -> dict[str, Any]:
    return await runtime.sessions.ping(sandbox_id)
