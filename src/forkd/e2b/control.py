"""E2B's control plane (the API ``E2B_API_URL`` points at): sandboxes and templates.

Paths, bodies and answers follow E2B's published OpenAPI document; every route but ``/health``
needs ``X-API-KEY``, whose principal (owner, admin) the front puts in the request's state: every
route sees only that owner's objects (all of them for an admin key). Request fields forkd has no use for (auto-pause, network, MCP, volumes) are
accepted and ignored, so the SDKs can send what they always send.
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
from forkd.e2b.network import egress, net_request
from forkd.e2b.sandboxes import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, E2BSandboxes

Timeout = Annotated[int, Field(ge=0, le=MAX_TIMEOUT_S, description="seconds from now")]
Labels = Annotated[dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=4096)]],
                   Field(max_length=64)]
SandboxId = Annotated[str, Field(min_length=1, max_length=64)]
PRINCIPAL_STATE = "e2b_principal"  # where the front leaves the caller's principal in the ASGI scope's state


def _principal(request: Request) -> Principal:
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


def control_router(sandboxes: E2BSandboxes) -> APIRouter:
    router = APIRouter(responses=ERRORS)

    @router.get("/health", status_code=200)
    async def health() -> dict[str, Any]:
        return {"ok": True, "forkd": __version__}

    async def create(body: NewSandbox, caller: Caller) -> JSONResponse:
        network = body.network or SandboxNetwork()
        net = net_request(body.allow_internet_access, network.allowOut, network.denyOut)
        created = await sandboxes.create(caller, body.templateID, body.timeout, body.metadata or {}, body.envVars or {},
                                         bool(network.allowPublicTraffic), net)
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

    return router


def control_app(sandboxes: E2BSandboxes) -> FastAPI:
    """The control plane as its own app (so it has its own OpenAPI document); auth sits in front of it."""
    app = FastAPI(title="forkd E2B control plane", version=__version__, openapi_url="/openapi.json",
                  docs_url=None, redoc_url=None)
    app.include_router(control_router(sandboxes))

    @app.exception_handler(E2BError)
    async def _e2b(_: Request, exc: E2BError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
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
