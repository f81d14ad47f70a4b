"""Health, metrics, version and host checks."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from forkd import __version__
from forkd.daemon import schemas
from forkd.daemon.deps import RuntimeDep
from forkd.host.doctor import run_checks
from forkd.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from forkd.store.io import long_job

router = APIRouter()


@router.get("/healthz", response_model=schemas.Health)
async def healthz() -> dict[str, Any]:
    return {"ok": True}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(runtime: RuntimeDep) -> PlainTextResponse:
    """Prometheus exposition: sandboxes by state, snapshots, spawn/branch/agent latencies, errors by route."""
    return PlainTextResponse(runtime.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)


@router.get("/v1/version")
async def version(runtime: RuntimeDep) -> dict[str, Any]:
    caps = runtime.capabilities()
    return {"forkd": __version__, "vmm": caps.kind, "vmm_version": caps.version,
            "accelerator": caps.accelerator, "accelerator_reason": caps.accelerator_reason,
            "capabilities": {"shared_memory_snapshots": caps.shared_memory_snapshots, "vmgenid": caps.vmgenid,
                             "background_snapshot": caps.background_snapshot}}


@router.get("/v1/doctor")
async def doctor(runtime: RuntimeDep) -> dict[str, Any]:
    return {"checks": [c.to_dict() for c in await long_job(run_checks, runtime.paths)]}  # probes take seconds
