"""E2B's control plane (the API ``E2B_API_URL`` points at): sandboxes and templates.

Paths, bodies and answers follow E2B's published OpenAPI document; every route but ``/health``
needs ``X-API-KEY``, whose principal (owner, admin) the front puts in the request's state: every
route sees only that owner's objects (all of them for an admin key). A route of E2B's this server
does not serve answers 501 "not supported by this server" (never a 404, which the SDKs read as
"sandbox not found"). Request fields forkd has no use for (``secure``, MCP) are accepted and ignored,
so the SDKs can send what they always send.
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from forkd import __version__
from forkd.e2b.errors import CONTROL_ERRORS, E2BError, to_http
from forkd.e2b.keys import Principal
from forkd.e2b.lifecycle import Policy
from forkd.e2b.metrics import Metrics
from forkd.e2b.network import egress, net_request
from forkd.e2b.sandboxes import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, E2BSandboxes
from forkd.e2b.snapshots import E2BSnapshots

Timeout = Annotated[int, Field(ge=0, le=MAX_TIMEOUT_S, description="seconds from now")]
Labels = Annotated[dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]],
                   Field(max_length=64)]
SandboxId = Annotated[str, Field(min_length=1, max_length=64)]
PRINCIPAL_STATE = "e2b_principal"  # where the front leaves the caller's principal in the ASGI scope's state


async def _principal(request: Request) -> Principal:
    """Async so FastAPI calls it on the event loop, not through its thread pool (two hand-overs a request)."""
    principal = getattr(request.state, PRINCIPAL_STATE, None)
    if principal is None:  # the front authenticates before routing; reaching here without is a bug
        raise E2BError(401, "no API key: send X-API-KEY (E2B_API_KEY)")
    return principal


Caller = Annotated[Principal, Depends(_principal)]


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields of E2B's schema that forkd ignores


Destinations = Annotated[list[Annotated[str, Field(min_length=1, max_length=253)]], Field(max_length=64)]


class NetworkUpdate(Loose):
    allowOut: Destinations | None = Field(default=None, description="IPv4 CIDRs or addresses let out (domains are "
                                                                    "refused); they win over denyOut")
    denyOut: Destinations | None = Field(default=None, description="IPv4 CIDRs or addresses refused; 0.0.0.0/0: all")
    allow_internet_access: bool | None = None


class SandboxNetwork(NetworkUpdate):
    allowPublicTraffic: bool | None = Field(default=None, description="true: the sandbox's own ports answer without "
                                                                      "its traffic token (default false)")


class NewSandbox(Loose):
    templateID: str = Field(min_length=1, max_length=64, description="a forkd snapshot tag")
    network: SandboxNetwork | None = None
    allow_internet_access: bool | None = Field(default=None, description="unset: no network (forkd's default); "
                                                                         "true: a NAT link; false: a link with "
                                                                         "everything refused (update_network opens it)")
    timeout: Timeout = DEFAULT_TIMEOUT_S
    metadata: Labels | None = None
    envVars: Labels | None = None
    autoPause: bool | None = None
    autoPauseMemory: bool | None = None
    autoResume: dict[str, Any] | bool | None = None


class SnapshotRequest(Loose):
    name: str | None = Field(default=None, max_length=256)
    memory: bool | None = None


class TimeoutRequest(Loose):
    timeout: Timeout


class ConnectRequest(Loose):
    timeout: Timeout = DEFAULT_TIMEOUT_S


class ForkRequest(Loose):
    timeout: Timeout = DEFAULT_TIMEOUT_S
    count: int = Field(default=1, ge=1, le=100)


class ErrorModel(BaseModel):
    code: int
    message: str


ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorModel} for status in (400, 401, 404, 409, 500)}


def _metadata_query(raw: str | None) -> dict[str, str]:
    """E2B's ``metadata`` filter: ``key=value&key2=value2`` with each part URL-encoded."""
    if not raw:
        return {}
    pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=False, max_num_fields=64)
    return {key: value for key, value in pairs}


def control_router(sandboxes: E2BSandboxes, snapshots: E2BSnapshots, metrics: Metrics) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.get("/health", status_code=200)
    async def health() -> dict[str, Any]:
        return {"ok": True, "forkd": __version__}

    async def create(body: NewSandbox, caller: Caller) -> JSONResponse:
        policy = Policy.from_request(body.autoPause, body.autoPauseMemory, body.autoResume)
        network = body.network or SandboxNetwork()
        net = net_request(body.allow_internet_access, network.allowOut, network.denyOut)
        created = await sandboxes.create(caller, body.templateID, body.timeout, body.metadata or {}, body.envVars or {},
                                         bool(network.allowPublicTraffic), net, policy)
        return JSONResponse(created, status_code=201)

    router.post("/sandboxes", status_code=201)(create)
    router.post("/v2/sandboxes", status_code=201)(create)

    @router.get("/sandboxes")
    async def list_v1(caller: Caller, metadata: Annotated[str | None, Query(max_length=8192)] = None) \
            -> list[dict[str, Any]]:
        return sandboxes.list(caller, _metadata_query(metadata), {"running"})

    @router.get("/v2/sandboxes")
    async def list_v2(response: Response, caller: Caller, metadata: Annotated[str | None, Query(max_length=8192)] = None,
                      state: Annotated[str | None, Query(max_length=64, pattern=r"^(running|paused)(,(running|paused))*$")] = None,
                      nextToken: Annotated[str | None, Query(max_length=12, pattern=r"^[0-9]+$")] = None,
                      limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[dict[str, Any]]:
        states = set(state.split(",")) if state else {"running", "paused"}
        found = sorted(sandboxes.list(caller, _metadata_query(metadata), states), key=lambda s: s["startedAt"], reverse=True)
        start = int(nextToken or 0)
        page = found[start:start + limit]
        if start + limit < len(found):
            response.headers["X-Next-Token"] = str(start + limit)
        response.headers["X-Total-Running"] = str(sum(1 for s in found if s["state"] == "running"))
        return page

    @router.get("/sandboxes/metrics")  # before /sandboxes/{sandboxID}, which would take it
    async def many_metrics(caller: Caller, sandbox_ids: Annotated[str, Query(min_length=1, max_length=8192)]) \
            -> dict[str, Any]:
        ids = [i for i in sandbox_ids.split(",") if i][:100]
        return metrics.latest(caller, ids)

    @router.get("/sandboxes/{sandboxID}")
    async def get_sandbox(sandboxID: SandboxId, caller: Caller) -> dict[str, Any]:
        return sandboxes.describe(sandboxes.resolve(sandboxID, caller), detail=True)

    @router.delete("/sandboxes/{sandboxID}", status_code=204)
    async def kill(sandboxID: SandboxId, caller: Caller) -> Response:
        await sandboxes.kill(caller, sandboxID)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandboxID}/timeout", status_code=204)
    async def set_timeout(sandboxID: SandboxId, body: TimeoutRequest, caller: Caller) -> Response:
        await sandboxes.set_timeout(caller, sandboxID, body.timeout)
        return Response(status_code=204)

    async def connect(sandboxID: SandboxId, body: ConnectRequest, caller: Caller) -> JSONResponse:
        status, answer = await sandboxes.connect(caller, sandboxID, body.timeout)
        return JSONResponse(answer, status_code=status)

    router.post("/sandboxes/{sandboxID}/connect", status_code=200)(connect)
    router.post("/v2/sandboxes/{sandboxID}/connect", status_code=200)(connect)

    @router.post("/sandboxes/{sandboxID}/resume", status_code=201)
    async def resume(sandboxID: SandboxId, caller: Caller, body: ConnectRequest | None = None) -> JSONResponse:
        if sandboxes.resolve(sandboxID, caller).live is not None:
            raise E2BError(409, f"sandbox {sandboxID} is already running")
        status, answer = await sandboxes.connect(caller, sandboxID, (body or ConnectRequest()).timeout)
        return JSONResponse(answer, status_code=status)

    @router.post("/sandboxes/{sandboxID}/pause", status_code=204)
    async def pause(sandboxID: SandboxId, caller: Caller) -> Response:
        await sandboxes.pause(caller, sandboxID)
        return Response(status_code=204)

    @router.put("/sandboxes/{sandboxID}/network", status_code=204)
    async def update_network(sandboxID: SandboxId, body: NetworkUpdate, caller: Caller) -> Response:
        """Replace a running sandbox's egress rules (it needs a link: one created with a network option)."""
        await sandboxes.set_egress(caller, sandboxID, egress(body.allow_internet_access, body.allowOut, body.denyOut))
        return Response(status_code=204)

    @router.post("/sandboxes/{sandboxID}/token", status_code=200)
    async def rotate_token(sandboxID: SandboxId, caller: Caller) -> dict[str, Any]:
        """forkd's own: a new access token for the sandbox (running or paused); the old one stops working."""
        return await sandboxes.rotate_token(caller, sandboxID)

    @router.post("/sandboxes/{sandboxID}/fork", status_code=201)
    async def fork(sandboxID: SandboxId, caller: Caller, body: ForkRequest | None = None) -> JSONResponse:
        body = body or ForkRequest()
        return JSONResponse(await sandboxes.fork(caller, sandboxID, body.count, body.timeout), status_code=201)

    @router.get("/templates")
    async def templates(caller: Caller) -> list[dict[str, Any]]:
        return sandboxes.templates(caller)

    @router.get("/sandboxes/{sandboxID}/metrics")
    async def sandbox_metrics(sandboxID: SandboxId, caller: Caller,
                              start: Annotated[int | None, Query(ge=0, le=1 << 40)] = None,
                              end: Annotated[int | None, Query(ge=0, le=1 << 40)] = None) -> list[dict[str, Any]]:
        return await metrics.get(caller, sandboxID, start, end)

    @router.post("/sandboxes/{sandboxID}/snapshots", status_code=201)
    async def create_snapshot(sandboxID: SandboxId, caller: Caller, body: SnapshotRequest | None = None) -> JSONResponse:
        body = body or SnapshotRequest()
        return JSONResponse(await snapshots.create(caller, sandboxID, body.name, body.memory), status_code=201)

    @router.get("/snapshots")
    async def list_snapshots(response: Response, caller: Caller,
                             sandboxID: Annotated[str | None, Query(max_length=64)] = None,
                             name: Annotated[str | None, Query(max_length=256)] = None,
                             nextToken: Annotated[str | None, Query(max_length=12, pattern=r"^[0-9]+$")] = None,
                             limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[dict[str, Any]]:
        found = snapshots.list(caller, sandboxID, name)
        start = int(nextToken or 0)
        if start + limit < len(found):
            response.headers["X-Next-Token"] = str(start + limit)
        return found[start:start + limit]

    @router.delete("/templates/tags", status_code=501, include_in_schema=False)  # E2B's path; the next would take it
    async def delete_tags(request: Request) -> None:
        raise unsupported(request.method, request.url.path)

    @router.delete("/templates/{templateID}", status_code=204)
    async def delete_snapshot(templateID: Annotated[str, Field(min_length=1, max_length=256)], caller: Caller) \
            -> Response:
        """E2B deletes snapshots (and templates) here: see E2BSnapshots.delete."""
        await snapshots.delete(caller, templateID)
        return Response(status_code=204)

    return router


def unsupported(method: str, path: str) -> E2BError:
    """E2B's answer for a route this server does not serve: 501, never a 404 (which both SDKs read as
    "sandbox not found", so a user could not tell "not supported" from "gone")."""
    return E2BError(501, f"{method} {path[:200]} is not supported by this server (forkd's E2B front); "
                         "see docs/e2b.md for what it serves")


def control_app(sandboxes: E2BSandboxes, snapshots: E2BSnapshots, metrics: Metrics) -> FastAPI:
    """The control plane as its own app (so it has its own OpenAPI document); auth sits in front of it."""
    app = FastAPI(title="forkd E2B control plane", version=__version__, openapi_url="/openapi.json",
                  docs_url=None, redoc_url=None)
    app.include_router(control_router(sandboxes, snapshots, metrics))

    @app.exception_handler(E2BError)
    async def _e2b(_: Request, exc: E2BError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):  # raised by routing only: the routes answer E2BError
            return JSONResponse(unsupported(request.method, request.url.path).body(), status_code=501)
        return JSONResponse({"code": exc.status_code, "message": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"code": 400, "message": problems}, status_code=400)

    async def _runtime(_: Request, exc: Exception) -> JSONResponse:
        error = to_http(exc)
        return JSONResponse(error.body(), status_code=error.status)

    for error_class in CONTROL_ERRORS:
        app.add_exception_handler(error_class, _runtime)
    return app
