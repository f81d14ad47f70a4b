"""The REST API: a thin FastAPI layer over the runtime; every client (CLI, SDK, curl) comes through here.

The routes live in ``routes/`` (one module per resource), NDJSON answers in ``ndjson.py``, the
mapping of runtime exceptions to error bodies in ``errors.py``; this module only assembles them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from fastapi import FastAPI

from forkd import __version__
from forkd.daemon import contract, errors, schemas
from forkd.daemon.middleware.metrics import RequestMetrics
from forkd.daemon.routes import ROUTERS
from forkd.errors import KINDS
from forkd.runtime.metrics import Metrics
from forkd.runtime.runtime import Runtime

log = logging.getLogger("forkd.daemon")


class Background(Protocol):
    """Work that runs beside the runtime (the E2B front's keeper): started once the runtime has
    recovered its sandboxes, stopped before it stops them."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...


def create_app(runtime: Runtime | None = None, background: Sequence[Background] = ()) -> FastAPI:
    """The API over an open ``runtime`` (``Runtime.open``), started and stopped with the app's lifespan.

    Without one, the app only describes itself (its OpenAPI document): nothing is opened or started.
    """
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if runtime is None:
            raise RuntimeError("this app was made without a runtime: it only renders its OpenAPI document")
        # Shutdown runs here, not after uvicorn returns: uvicorn re-raises SIGTERM once it has
        # served, which would end the process before any later cleanup.
        recovered = await runtime.start()
        caps = await asyncio.to_thread(runtime.capabilities)  # asks the VMM binary its version: off the loop
        runtime.metrics.set_build(__version__, caps.kind, caps.version)
        if recovered.adopted:
            log.info("re-adopted %d sandboxes: %s", len(recovered.adopted), ", ".join(recovered.adopted))
        if recovered.reaped or recovered.removed_builds:
            log.warning("reaped %d sandboxes a previous daemon left (%s) and %d half-built snapshots",
                        len(recovered.reaped), ", ".join(recovered.reaped), len(recovered.removed_builds))
        if recovered.failed:
            log.error("could not reap %d sandboxes (%s); the next start tries again",
                      len(recovered.failed), ", ".join(recovered.failed))
        for work in background:
            work.start()
        yield
        for work in background:
            await work.stop()
        await runtime.stop()

    app = FastAPI(title="forkd", version=__version__, lifespan=lifespan, responses=schemas.ERROR_RESPONSES,
                  description="Fork warm microVMs copy-on-write; every forkd client speaks this API.")
    app.state.runtime = runtime

    def openapi_with_error_kinds() -> dict[str, Any]:
        """FastAPI's document plus the error table, so clients in other languages generate it, not copy it."""
        if app.openapi_schema is None:
            document = contract.finish_document(FastAPI.openapi(app), ROUTERS)
            document["x-error-kinds"] = [dataclasses.asdict(kind) for kind in KINDS.values()]
        return app.openapi_schema  # type: ignore[return-value]  # set by FastAPI.openapi just above

    app.openapi = openapi_with_error_kinds  # type: ignore[method-assign]  # FastAPI's documented hook
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(RequestMetrics, metrics=runtime.metrics if runtime is not None else Metrics())
    errors.install(app)
    return app
