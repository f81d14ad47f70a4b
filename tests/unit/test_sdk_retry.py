"""A ``busy`` daemon (503: over a concurrency cap, nothing done) is asked again: after its ``Retry-After``, else
after a backoff, at most ``BUSY_RETRIES`` times, never with a streamed upload; the daemon sends the header."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from forkd.daemon.errors import BUSY_RETRY_AFTER_S, install
from forkd.runtime.branches import BranchBusy
from forkd.sdk import async_controller, controller
from forkd.sdk.async_controller import AsyncController
from forkd.sdk.controller import Controller
from forkd.sdk.errors import RateLimitException
from forkd.sdk.retry import BUSY_RETRIES

BASE = "http://forkd"
BUSY = {"error": {"code": "busy", "message": "2 branches are being written"}}


def busy_then_ok(refusals: int, headers: dict[str, str] | None = None) -> tuple[list[httpx.Request], httpx.MockTransport]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) <= refusals:
            return httpx.Response(503, json=BUSY, headers=headers)
        return httpx.Response(200, json={"ok": True})
    return seen, httpx.MockTransport(handler)


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pauses the clients took, instead of taking them."""
    taken: list[float] = []

    async def async_sleep(seconds: float) -> None:
        taken.append(seconds)

    monkeypatch.setattr(controller.time, "sleep", taken.append)
    monkeypatch.setattr(async_controller.asyncio, "sleep", async_sleep)
    return taken


def test_a_busy_answer_is_asked_again_after_retry_after(pauses: list[float]) -> None:
    seen, transport = busy_then_ok(2, {"Retry-After": "3"})
    api = Controller(url=BASE, http=httpx.Client(transport=transport, base_url=BASE))
    assert api.request("GET", "/healthz") == {"ok": True}
    assert len(seen) == 3 and pauses == [3.0, 3.0]


def test_without_retry_after_the_pauses_back_off_then_the_refusal_is_raised(pauses: list[float]) -> None:
    seen, transport = busy_then_ok(100)
    api = Controller(url=BASE, http=httpx.Client(transport=transport, base_url=BASE))
    with pytest.raises(RateLimitException, match="branches are being written"):
        api.health()
    assert len(seen) == BUSY_RETRIES + 1 and pauses == [0.5, 1.0, 2.0]


def test_the_async_client_retries_alike_and_a_streamed_upload_is_never_resent(pauses: list[float]) -> None:
    seen, transport = busy_then_ok(1, {"Retry-After": "999"})
    api = AsyncController(url=BASE, http=httpx.AsyncClient(transport=transport, base_url=BASE))
    assert asyncio.run(api.request("GET", "/healthz")) == {"ok": True}
    assert pauses == [30.0]  # a Retry-After is waited for at most MAX_PAUSE_S in one call

    def pieces() -> Iterator[bytes]:
        yield b"data"

    seen, transport = busy_then_ok(1)
    sync = Controller(url=BASE, http=httpx.Client(transport=transport, base_url=BASE))
    with pytest.raises(RateLimitException):
        sync.write_file("sb-000000000000", "/root/f", pieces())
    assert len(seen) == 1


def test_the_daemon_answers_busy_with_retry_after() -> None:
    app = FastAPI()
    install(app)

    @app.get("/busy")
    async def busy() -> None:
        raise BranchBusy("2 branches are being written (the limit is 2)")

    @app.get("/missing")
    async def missing() -> None:
        raise LookupError("no sandbox sb-000000000000")

    client = TestClient(app)
    answer = client.get("/busy")
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "busy"
    assert answer.headers["Retry-After"] == BUSY_RETRY_AFTER_S
    assert "Retry-After" not in client.get("/missing").headers
