"""Code-interpreter contexts, as E2B's code interpreter has them: create, list, restart, remove.

Each context is a process in the guest forked from the snapshot's warm interpreter; ``run_code``
names one with its ``context`` field (a name that does not exist yet is created on first use).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from forkd.daemon import schemas
from forkd.daemon.deps import SandboxId, SessionsDep

router = APIRouter()


@router.post("/v1/sandboxes/{sandbox_id}/contexts", status_code=201)
async def create_context(sandbox_id: SandboxId, body: schemas.ContextCreate, sessions: SessionsDep) -> dict[str, Any]:
    return await sessions.create_context(sandbox_id, body.id, body.cwd, body.language)


@router.get("/v1/sandboxes/{sandbox_id}/contexts")
async def list_contexts(sandbox_id: SandboxId, sessions: SessionsDep) -> dict[str, Any]:
    return await sessions.contexts(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/contexts/{context_id}/restart")
async def restart_context(sandbox_id: SandboxId, context_id: schemas.Tag, sessions: SessionsDep) -> dict[str, Any]:
    return await sessions.restart_context(sandbox_id, context_id)


@router.delete("/v1/sandboxes/{sandbox_id}/contexts/{context_id}")
async def remove_context(sandbox_id: SandboxId, context_id: schemas.Tag, sessions: SessionsDep) -> dict[str, Any]:
    await sessions.remove_context(sandbox_id, context_id)
    return {"removed": context_id}
