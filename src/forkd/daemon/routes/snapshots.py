"""Snapshots: list (with disk use), create (NDJSON progress), remove."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from forkd.daemon import schemas, snapshot_answers
from forkd.daemon.deps import RuntimeDep
from forkd.daemon.ndjson import NDJSON_ANSWER, NDJSONResponse, detached, progress_line
from forkd.runtime.snapshots import SnapshotRequest

router = APIRouter()


@router.get("/v1/snapshots", response_model=snapshot_answers.SnapshotList)
async def snapshots(runtime: RuntimeDep) -> dict[str, Any]:
    return {"snapshots": await runtime.snapshot_listing()}  # walks the store on its own threads


@router.post("/v1/snapshots", response_class=NDJSONResponse, responses=NDJSON_ANSWER)
async def create_snapshot(body: schemas.SnapshotCreate, runtime: RuntimeDep) -> NDJSONResponse:
    request = SnapshotRequest(tag=body.tag, image=body.image, memory_mib=body.memory_mib, vcpus=body.vcpus,
                              warm_modules=tuple(body.warm_modules), warm_code=body.warm_code,
                              warmup_cmd=body.warmup_cmd, machine=body.machine)
    request = runtime.snapshots.resolve(request)  # a machine the backend cannot run: 400 before anything starts
    claim = runtime.snapshots.claim(body.tag)  # a taken or claimed tag is a 409 before any streaming starts

    async def work(emit):  # type: ignore[no-untyped-def]
        record = await runtime.create_snapshot(request, lambda line: emit(progress_line(line)), claim=claim)
        return record.to_dict()

    return detached(work)


@router.delete("/v1/snapshots/{tag}")
async def remove_snapshot(tag: str, runtime: RuntimeDep, cascade: bool = False, force: bool = False) -> dict[str, Any]:
    return {"removed": tag, "removed_tags": await runtime.remove_snapshot(tag, cascade=cascade, force=force)}
