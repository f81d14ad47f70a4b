"""BRANCH and snapshot chains: branch a sandbox, describe a snapshot's chain, compact, diff."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from forkd.daemon import schemas, snapshot_answers
from forkd.daemon.deps import RuntimeDep, SandboxId

router = APIRouter()


@router.post("/v1/sandboxes/{sandbox_id}/branch", status_code=201)
async def branch(sandbox_id: SandboxId, body: schemas.BranchRequest, runtime: RuntimeDep) -> JSONResponse:
    """201 with the ready snapshot, or 202 with it ``writing`` once the sandbox runs again when ``wait`` is false."""
    record = await runtime.branches.branch(sandbox_id, body.tag, body.mode, body.wait)
    return JSONResponse(record.to_dict(), status_code=201 if record.status == "ready" else 202)


@router.get("/v1/snapshots/{tag}", response_model=snapshot_answers.DescribedSnapshot)
async def snapshot_info(tag: str, runtime: RuntimeDep) -> dict[str, Any]:
    return runtime.describe_snapshot(tag)


@router.post("/v1/snapshots/compact", status_code=201)
async def compact(body: schemas.CompactRequest, runtime: RuntimeDep) -> dict[str, Any]:
    """A standalone copy of ``from_tag``'s whole chain (no parent) named ``to_tag``."""
    return (await runtime.compaction.compact(body.from_tag, body.to_tag)).to_dict()


@router.post("/v1/snapshots/diff", status_code=201)
async def diff(body: schemas.DiffRequest, runtime: RuntimeDep) -> dict[str, Any]:
    """Run ``cmd`` in a fresh child of ``base_tag`` and keep what it changed as diff snapshot ``tag``."""
    return (await runtime.branches.diff_exec(body.base_tag, body.tag, body.cmd, body.timeout_s)).to_dict()
