"""Guest images: list, build (NDJSON progress), remove."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter

from forkd.daemon import schemas
from forkd.daemon.deps import RuntimeDep
from forkd.daemon.ndjson import NDJSON_ANSWER, NDJSONResponse, detached, progress_line
from forkd.image.builder import ImageSpec
from forkd.image.spec import BASE_PACKAGES

router = APIRouter()


@router.get("/v1/images")
async def images(runtime: RuntimeDep) -> dict[str, Any]:
    return {"images": [i.to_dict() for i in runtime.images()]}


@router.post("/v1/images", response_class=NDJSONResponse, responses=NDJSON_ANSWER)
async def build_image(body: schemas.ImageBuild, runtime: RuntimeDep) -> NDJSONResponse:
    spec = ImageSpec(name=body.name, packages=tuple(dict.fromkeys((*BASE_PACKAGES, *body.packages))),
                     mirror=body.mirror, source_dir=Path(body.source_dir) if body.source_dir else None,
                     source_oci=Path(body.source_oci) if body.source_oci else None, disk_size_mib=body.disk_size_mib,
                     ca_certs=tuple(body.ca_certs))
    spec = runtime.confine_image_sources(spec)  # refused before the stream starts

    async def work(emit):  # type: ignore[no-untyped-def]
        image = await runtime.build_image(spec, lambda line: emit(progress_line(line)), force=body.force)
        return image.to_dict()

    return detached(work)


@router.delete("/v1/images/{name}")
async def remove_image(name: str, runtime: RuntimeDep) -> dict[str, Any]:
    await runtime.remove_image(name)
    return {"removed": name}
