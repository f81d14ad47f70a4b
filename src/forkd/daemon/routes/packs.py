"""Snapshot packs: pack, unpack, pull and push (the daemon owns the store).

Each answers NDJSON progress then the result, like image builds. What can be refused quickly (a
taken tag, a pack for another machine, a bad manifest) is refused before the stream starts, so it
comes back with its own HTTP status rather than as the stream's last line.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter

from forkd.daemon import schemas
from forkd.daemon.deps import RuntimeDep
from forkd.daemon.ndjson import NDJSON_ANSWER, NDJSONResponse, detached, progress_line
from forkd.packs.archive import check_output
from forkd.store.io import long_job

router = APIRouter(prefix="/v1/packs", tags=["packs"])


@router.post("", response_class=NDJSONResponse, responses=NDJSON_ANSWER)
async def pack(body: schemas.PackCreate, runtime: RuntimeDep) -> NDJSONResponse:
    packs = runtime.packs
    packs.chain(body.tag)  # 404 for an unknown snapshot, before streaming
    output = packs.pack_output(Path(body.path))
    check_output(output, body.force)
    return detached(lambda emit: packs.pack(body.tag, output, body.force, lambda line: emit(progress_line(line))))


@router.post("/unpack", response_class=NDJSONResponse, responses=NDJSON_ANSWER)
async def unpack(body: schemas.PackUnpack, runtime: RuntimeDep) -> NDJSONResponse:
    packs = runtime.packs
    manifest = await long_job(packs.inspect, Path(body.path))  # reads into a pack someone else made
    await asyncio.to_thread(packs.plan, manifest, body.tag, body.force)  # stats the store's files and free space
    claim = packs.claim(manifest, body.tag)  # a tag another request holds is a 409 before streaming
    return detached(lambda emit: packs.unpack(Path(body.path), body.tag, body.force,
                                              lambda line: emit(progress_line(line)), claim))


@router.post("/pull", response_class=NDJSONResponse, responses=NDJSON_ANSWER)
async def pull(body: schemas.PackPull, runtime: RuntimeDep) -> NDJSONResponse:
    packs = runtime.packs
    source = await packs.resolve(body.url, body.index, body.name, body.sha256, body.tag)
    if source.tag is not None:
        packs.check_target(source.tag, body.force)
    return detached(lambda emit: packs.pull(source, body.force, lambda line: emit(progress_line(line))))


@router.post("/push", response_class=NDJSONResponse, responses=NDJSON_ANSWER)
async def push(body: schemas.PackPush, runtime: RuntimeDep) -> NDJSONResponse:
    packs = runtime.packs
    packs.chain(body.tag)
    packs.check_push_url(body.url)
    return detached(lambda emit: packs.push(body.tag, body.url, lambda line: emit(progress_line(line))))
