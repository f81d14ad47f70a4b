"""Pools of ready VMMs over REST: list them with their idle memory, set a snapshot's pool size."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from forkd.daemon import schemas
from forkd.runtime.pool import PoolService
from forkd.validation import check_tag

router = APIRouter()


def _pools(request: Request) -> PoolService:
    return request.app.state.runtime.sandboxes.pool


@router.get("/v1/pools", response_model=schemas.PoolList)
async def list_pools(request: Request) -> dict[str, Any]:
    return {"pools": _pools(request).list()}


@router.get("/v1/pools/{tag}", response_model=schemas.Pool)
async def get_pool(tag: str, request: Request) -> dict[str, Any]:
    return _pools(request).describe(check_tag(tag))


@router.put("/v1/pools/{tag}", response_model=schemas.Pool)
async def resize_pool(tag: str, body: schemas.PoolResize, request: Request) -> dict[str, Any]:
    """Keep ``size`` ready VMMs of the snapshot from now on; members beyond it are killed at once."""
    return await _pools(request).set_size(check_tag(tag), body.size)
