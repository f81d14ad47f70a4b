"""Workspaces: create, list, suspend (BRANCH then stop), resume (fork), remove."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from forkd.daemon import schemas
from forkd.runtime.workspaces import WorkspaceService

router = APIRouter()


async def _workspaces(request: Request) -> WorkspaceService:
    return request.app.state.runtime.workspaces


Workspaces = Annotated[WorkspaceService, Depends(_workspaces)]


@router.post("/v1/workspaces", status_code=201)
async def create_workspace(body: schemas.WorkspaceCreate, service: Workspaces) -> dict[str, Any]:
    return service.describe(await service.create(body.name, body.snapshot_tag))


@router.get("/v1/workspaces")
async def list_workspaces(service: Workspaces) -> dict[str, Any]:
    return {"workspaces": [service.describe(w) for w in service.records()]}


@router.get("/v1/workspaces/{name}")
async def get_workspace(name: str, service: Workspaces) -> dict[str, Any]:
    return service.describe(service.get(name))


@router.post("/v1/workspaces/{name}/suspend")
async def suspend_workspace(name: str, service: Workspaces) -> dict[str, Any]:
    return service.describe(await service.suspend(name))


@router.post("/v1/workspaces/{name}/resume")
async def resume_workspace(name: str, service: Workspaces) -> dict[str, Any]:
    return service.describe(await service.resume(name))


@router.delete("/v1/workspaces/{name}")
async def remove_workspace(name: str, service: Workspaces) -> dict[str, Any]:
    return {"removed": name, "removed_tags": await service.remove(name)}
