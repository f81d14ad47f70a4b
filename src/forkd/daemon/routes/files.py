"""Files inside a sandbox: raw bytes in and out (chunked to the agent), list, stat, remove, mkdir, rename."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from forkd.daemon import schemas
from forkd.daemon.deps import SandboxId, SessionsDep

router = APIRouter()
GuestPath = Annotated[str, Query(min_length=1, max_length=4096)]
BYTES_ANSWER: dict[int | str, dict[str, Any]] = {200: {
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    "description": "the file's bytes"}}


@router.get("/v1/sandboxes/{sandbox_id}/files", response_class=StreamingResponse, responses=BYTES_ANSWER)
async def read_file(sandbox_id: SandboxId, path: GuestPath, sessions: SessionsDep) -> StreamingResponse:
    download = await sessions.read_file(sandbox_id, path)
    return StreamingResponse(download.chunks, media_type="application/octet-stream",
                             headers={"X-File-Size": "" if download.size is None else str(download.size)})


@router.put("/v1/sandboxes/{sandbox_id}/files")
async def write_file(sandbox_id: SandboxId, path: GuestPath, request: Request, sessions: SessionsDep,
                     mode: Annotated[int | None, Query(ge=0, le=0o7777)] = None) -> dict[str, Any]:
    return {"path": path, "size": await sessions.write_file(sandbox_id, path, request.stream(), mode)}


@router.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=schemas.FileList)
async def list_files(sandbox_id: SandboxId, path: GuestPath, sessions: SessionsDep) -> dict[str, Any]:
    return await sessions.list_files(sandbox_id, path)


@router.get("/v1/sandboxes/{sandbox_id}/files/stat", response_model=schemas.FileEntry)
async def stat_file(sandbox_id: SandboxId, path: GuestPath, sessions: SessionsDep) -> dict[str, Any]:
    return await sessions.stat(sandbox_id, path)


@router.delete("/v1/sandboxes/{sandbox_id}/files")
async def remove_file(sandbox_id: SandboxId, path: GuestPath, sessions: SessionsDep,
                      recursive: bool = False) -> dict[str, Any]:
    return await sessions.remove(sandbox_id, path, recursive)


@router.post("/v1/sandboxes/{sandbox_id}/files/mkdir")
async def make_dir(sandbox_id: SandboxId, body: schemas.PathBody, sessions: SessionsDep) -> dict[str, Any]:
    return await sessions.make_dir(sandbox_id, body.path)


@router.post("/v1/sandboxes/{sandbox_id}/files/rename")
async def rename_file(sandbox_id: SandboxId, body: schemas.RenameBody, sessions: SessionsDep) -> dict[str, Any]:
    return await sessions.rename(sandbox_id, body.src, body.dst)
