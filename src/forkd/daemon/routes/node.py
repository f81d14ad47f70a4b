"""This daemon as a node of a cluster: what it is and holds, and snapshots moved between nodes by digest."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from starlette.responses import StreamingResponse

from forkd.daemon import schemas
from forkd.daemon.deps import RuntimeDep
from forkd.packs.peer import chain_to_send, stream_pack
from forkd.packs.format import MAX_CHAIN_DEPTH

router = APIRouter(prefix="/v1/node", tags=["node"])
DIGEST = r"^[0-9a-f]{64}$"
HAVE = r"^([0-9a-f]{64}(,[0-9a-f]{64})*)?$"
Digest = Annotated[str, PathParam(pattern=DIGEST, description="the chain's top layer digest")]
PACK = {200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
              "description": "a forkd pack (tar.zst) of the chain without the layers listed in `have`"}}


@router.get("", response_model=schemas.Node)
async def node(runtime: RuntimeDep) -> dict[str, Any]:
    """Node id, compatibility key, capacity and the snapshots held here by digest."""
    return await runtime.node.describe()


@router.get("/chains/{digest}", response_class=StreamingResponse, responses=PACK)
async def chain(digest: Digest, runtime: RuntimeDep,
                have: Annotated[str, Query(max_length=65 * MAX_CHAIN_DEPTH, pattern=HAVE, description=(
                    "comma-separated digests of the root-side layers the puller holds"))] = "") -> StreamingResponse:
    """Stream the chain ending at ``digest`` to a peer, written as it is read (never a file here)."""
    held = set(have.split(",")) - {""}
    sources = await asyncio.to_thread(chain_to_send, runtime.packs, digest, held)  # 404 before streaming
    return StreamingResponse(stream_pack(sources), media_type="application/octet-stream")


@router.post("/pull", response_model=schemas.PullOutcome)
async def pull(body: schemas.NodePull, runtime: RuntimeDep) -> dict[str, Any]:
    """Pull the layers of a chain this node lacks from a peer, verified like an unpack, all or nothing."""
    return await runtime.peers.pull(body.digest, body.source, body.source_token, lambda _line: None)


@router.post("/drain", response_model=schemas.DrainOutcome)
async def drain(runtime: RuntimeDep, body: schemas.NodeDrain | None = None) -> dict[str, Any]:
    """Take no new forks from now on (503 ``draining``); running sandboxes carry on. With ``wait_s``, answer
    once none is left or that time has passed: what is left."""
    return await runtime.drain.drain((body or schemas.NodeDrain()).wait_s)


@router.delete("/drain", response_model=schemas.DrainOutcome)
async def undrain(runtime: RuntimeDep) -> dict[str, Any]:
    """Take forks again (and refill the pools)."""
    return await runtime.drain.undrain()
