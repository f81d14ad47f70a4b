"""Pools of ready VMMs: list them with the memory their idle members hold, set a snapshot's pool size."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from forkd.daemon import schemas
from forkd.daemon.deps import RuntimeDep
from forkd.validation import check_tag

router = APIRouter()


@router.get("/v1/pools", response_model=schemas.PoolList)
async def list_pools(runtime: RuntimeDep) -> dict[str, Any]:
    return {"pools": runtime.pools.list()}


@router.get("/v1/pools/{tag}", response_model=schemas.Pool)
async def get_pool(tag: str, runtime: RuntimeDep) -> dict[str, Any]:
    return runtime.pools.describe(check_tag(tag))


@router.put("/v1/pools/{tag}", response_model=schemas.Pool)
async def resize_pool(tag: str, body: schemas.PoolResize, runtime: RuntimeDep) -> dict[str, Any]:
    """Keep ``size`` ready VMMs of the snapshot from now on; members beyond it are killed at once."""
    return await runtime.pools.set_size(check_tag(tag), body.size)
