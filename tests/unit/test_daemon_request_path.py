"""The daemon's per-request path: no thread hand-over before a route runs, and the stages a client may ask for."""

from __future__ import annotations

import asyncio
import inspect
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from forkd.daemon.app import create_app
from forkd.daemon.middleware.timing import ServerTiming
from forkd.e2b.control import control_app
from forkd.runtime import timings
from forkd.runtime.metrics import Metrics

pytestmark = pytest.mark.timeout(30)
SANDBOX = "sb-aaaaaaaaaaaa"


def _dependencies(dependant: Dependant) -> list[Any]:
    found = []
    for sub in dependant.dependencies:
        found.append(sub.call)
        found.extend(_dependencies(sub))
    return found


def _api_routes(routes: list[Any]) -> list[APIRoute]:
    """Every APIRoute, also those of included routers (which FastAPI keeps in a wrapper of their own)."""
    found = []
    for route in routes:
        if isinstance(route, APIRoute):
            found.append(route)
        inner = getattr(getattr(route, "original_router", route), "routes", None)
        if inner is not None and not isinstance(route, APIRoute):
            found.extend(_api_routes(inner))
    return found


def test_no_route_dependency_runs_in_the_thread_pool() -> None:
    """FastAPI runs a plain ``def`` dependency in its thread pool: two thread hand-overs per dependency and
    request, which cost a ping most of its time in the daemon on a loaded host. The E2B control plane too."""
    e2b = _api_routes(control_app(None, None, None).routes)  # type: ignore[arg-type]  # routes only, never called
    routes = _api_routes(create_app().routes) + e2b
    assert len(routes) > 50 and len(e2b) > 10
    sync = {f"{route.path}: {call.__qualname__}" for route in routes
            for call in _dependencies(route.dependant) if not inspect.iscoroutinefunction(call)}
    assert not sync


class _Sessions:
    def __init__(self) -> None:
        self.seen: list[timings.Timings | None] = []
        self.threads: list[int] = []

    async def ping(self, sandbox_id: str) -> dict[str, Any]:
        self.seen.append(timings.CURRENT.get())
        self.threads.append(threading.get_ident())
        timings.mark("routed")
        return {"agent_version": "x"}


def _ping(headers: dict[str, str]) -> tuple[httpx.Response, _Sessions]:
    sessions = _Sessions()
    app = ServerTiming(create_app(SimpleNamespace(sessions=sessions, metrics=Metrics())))  # type: ignore[arg-type]

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://forkd") as client:
            return await client.post(f"/v1/sandboxes/{SANDBOX}/ping", headers=headers)

    return asyncio.run(call()), sessions


def test_a_client_that_asks_gets_the_stages_of_its_request() -> None:
    answer, sessions = _ping({"X-Forkd-Timings": "1"})
    assert answer.status_code == 200 and sessions.seen[0] is not None
    stages = dict(part.strip().split(";dur=") for part in answer.headers["server-timing"].split(","))
    assert list(stages) == ["routed", "answer_ready", "total"]
    assert float(stages["total"]) >= float(stages["routed"]) >= 0
    # A task started during the request keeps its context: once answered, its Timings take no more marks.
    seen = sessions.seen[0]
    seen.mark("late")
    assert seen.closed and list(seen.stages()) == ["routed", "answer_ready"]


def test_a_client_that_does_not_ask_pays_nothing_for_it() -> None:
    answer, sessions = _ping({})
    assert answer.status_code == 200 and "server-timing" not in answer.headers
    assert sessions.seen == [None]
    assert timings.CURRENT.get() is None
