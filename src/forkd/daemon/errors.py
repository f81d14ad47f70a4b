"""Exceptions to API error bodies, by the kind of ``forkd.errors`` each carries (``kind_for``).

Every error the daemon answers has the documented body ``{"error": {"code", "message"}}`` with its
kind's status, including the ones FastAPI and Starlette raise themselves (a malformed JSON body, an
unknown route or method), so no client ever sees a bare ``{"detail": ...}``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.routing import Route

from forkd.errors import KINDS, ErrorKind, kind_for, kind_for_status, message_for
from forkd.daemon.middleware.body_limit import BodyTooLarge
from forkd.image.builder import ImageError
from forkd.packs.format import PackError
from forkd.packs.peer import IncompatibleSnapshot
from forkd.runtime.driver_forks import IdempotencyConflict
from forkd.runtime.agent_client import AgentError, AgentUnavailable
from forkd.runtime.sandboxes import SandboxEnded
from forkd.runtime.spawning import Draining
from forkd.store.errors import DiskFull, SnapshotError
from forkd.validation import ValidationError
from forkd.vmm.base import VmmError

# Registered per class (not for Exception, which Starlette re-raises after answering); each carries its
# kind (``forkd.errors.kind_for``), which gives the status and code.
HANDLED_ERRORS = (ValidationError, LookupError, SnapshotError, ImageError, VmmError, AgentError, OSError, PackError,
                  SandboxEnded, IncompatibleSnapshot, IdempotencyConflict, Draining, DiskFull)


T = TypeVar("T")
BUSY_RETRY_AFTER_S = "1"  # seconds; a branch or fork slot frees in about that time on a loaded host


class ClientGone(Exception):
    """The client disconnected before its answer was ready; the call was ended (answered 499, seen by no one)."""


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so its guest call) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and JSON body for an exception raised by the runtime."""
    kind = kind_for(exc)
    if isinstance(exc, AgentError) and not isinstance(exc, AgentUnavailable):
        return kind.status, kind.body(exc.message, **exc.details)
    return kind.status, kind.body(message_for(exc))


def answer(kind: ErrorKind, message: str) -> JSONResponse:
    return JSONResponse(kind.body(message), status_code=kind.status)


def _problems(exc: RequestValidationError) -> tuple[str, bool]:
    """A readable list of what failed the schema, and whether the body was not JSON at all."""
    malformed = any(e.get("type") == "json_invalid" for e in exc.errors())
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()), malformed


def allowed_methods(request: Request) -> str:
    """Every method some route of the app serves on this request's path (RFC 9110's ``Allow``)."""
    methods: set[str] = set()
    pending = list(request.app.router.routes)
    while pending:
        route = pending.pop()
        if hasattr(route, "original_router"):  # FastAPI's included router: its own routes carry the full paths
            pending.extend(route.original_router.routes)
        elif isinstance(route, Route) and route.path_regex.match(request.url.path):
            methods |= route.methods or set()
    return ", ".join(sorted(methods))


def install(app: FastAPI) -> None:
    """Answer every error the app can raise with the documented body."""
    async def runtime_error(_: Request, exc: Exception) -> JSONResponse:
        status, body = error_body(exc)
        busy = kind_for(exc) is KINDS["busy"]  # nothing was done: the client may ask again (forkd.sdk.retry)
        return JSONResponse(body, status_code=status, headers={"Retry-After": BUSY_RETRY_AFTER_S} if busy else None)

    for error_class in HANDLED_ERRORS:
        app.add_exception_handler(error_class, runtime_error)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; it shows in the audit log

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, __: BodyTooLarge) -> JSONResponse:
        return answer(KINDS["body_too_large"], "request body over this route's limit")

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems, malformed = _problems(exc)
        if malformed:
            return answer(KINDS["malformed_body"], f"the body is not valid JSON ({problems})")
        return answer(KINDS["invalid_request"], problems)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            return answer(KINDS["malformed_body"], "the body is not valid JSON")
        response = answer(kind_for_status(exc.status_code), detail)
        response.status_code = exc.status_code
        if exc.headers:
            response.headers.update(exc.headers)
        if exc.status_code == 405:  # Starlette names the first matching route's methods; a path may have several
            response.headers["Allow"] = allowed_methods(request)
        return response
