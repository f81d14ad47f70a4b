"""Code-interpreter contexts over REST, as E2B's code interpreter has them: create, list, restart, remove.

Each context is a process in the guest forked from the snapshot's warm interpreter; ``run_code``
names one with its ``context`` field (a context it names that does not exist yet is created).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from forkd.daemon import schemas
from forkd.guest import protocol
from forkd.validation import check_sandbox_id

router = APIRouter()

_CALL_TIMEOUT_S = 60.0


async def _call(request: Request, sandbox_id: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
    live = request.app.state.runtime.sandboxes.get(check_sandbox_id(sandbox_id))
    return await live.agent.call(op, args, timeout=_CALL_TIMEOUT_S)


@router.post("/v1/sandboxes/{sandbox_id}/contexts", status_code=201)
async def create_context(sandbox_id: str, body: schemas.ContextCreate, request: Request) -> dict[str, Any]:
    return await _call(request, sandbox_id, protocol.OP_CONTEXTS_CREATE, body.model_dump(exclude_none=True))


@router.get("/v1/sandboxes/{sandbox_id}/contexts")
async def list_contexts(sandbox_id: str, request: Request) -> dict[str, Any]:
    return await _call(request, sandbox_id, protocol.OP_CONTEXTS_LIST, {})


@router.post("/v1/sandboxes/{sandbox_id}/contexts/{context_id}/restart")
async def restart_context(sandbox_id: str, context_id: schemas.Tag, request: Request) -> dict[str, Any]:
    return await _call(request, sandbox_id, protocol.OP_CONTEXTS_RESTART, {"id": context_id})


@router.delete("/v1/sandboxes/{sandbox_id}/contexts/{context_id}")
async def remove_context(sandbox_id: str, context_id: schemas.Tag, request: Request) -> dict[str, Any]:
    await _call(request, sandbox_id, protocol.OP_CONTEXTS_DELETE, {"id": context_id})
    return {"removed": context_id}
