"""A fork batch where one child fails, seen from every front: the REST API (plain and streamed), the
SDK (``Sandbox.fork``, ``Sandbox.create``) and the MCP ``spawn`` tool all report that child as a
``{code, message}`` object of the error table (``forkd.errors``), next to the children that started.

A whole daemon process on the fake VMM backend (real config, socket, SQLite, store, guest protocol; no
VM) whose ``max_sandboxes`` makes the last child of a batch fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import Client

from conftest import fake_daemon_on
from forkd.errors import Failure
from forkd.mcp.server import build_server
from forkd.sdk.async_controller import AsyncController
from forkd.sdk.controller import Controller
from forkd.sdk.errors import RateLimitException
from forkd.sdk.models import ForkFailed
from forkd.sdk.sandbox_async import AsyncSandbox
from forkd.sdk.sandbox_sync import Sandbox

LIMIT = 2  # the daemon's max_sandboxes: a batch of LIMIT + 1 has its last child refused


@pytest.fixture
def daemon(fake_home: Path) -> Iterator[str]:
    """The URL of a daemon on the fake backend holding snapshot ``base``."""
    with fake_daemon_on(fake_home, f"[limits]\nmax_sandboxes = {LIMIT}\n") as controller:
        controller.create_snapshot("base", memory_mib=128, warm_modules=[])
        yield controller.url


def _kill_all(controller: Controller) -> None:
    for sandbox in controller.sandboxes():
        controller.kill(sandbox["id"])


def _is_refused(error: dict[str, object], index: int) -> None:
    assert (error["index"], error["code"]) == (index, "busy"), error
    assert "max_sandboxes" in str(error["message"])


def test_rest_reports_the_failed_child_as_a_typed_error(daemon: str) -> None:
    with Controller(url=daemon) as controller:
        result = controller.fork("base", LIMIT + 1)
        assert len(result["sandboxes"]) == LIMIT
        [error] = result["errors"]
        _is_refused(error, LIMIT)
        _kill_all(controller)

        lines = list(controller.fork_iter("base", LIMIT + 1))
        [failed] = [line for line in lines if "error" in line]
        assert failed["error"]["code"] == "busy" and set(failed["error"]) == {"code", "message"}
        assert sorted(line["index"] for line in lines) == list(range(LIMIT + 1))
        _kill_all(controller)


def test_the_sdk_reports_the_failed_child_with_its_code(daemon: str) -> None:
    parent = Sandbox("base", url=daemon)
    try:
        with pytest.raises(ForkFailed) as raised:
            parent.fork(LIMIT)  # the parent holds one of the LIMIT slots
        outcome = raised.value.outcome
        assert [c.index for c in outcome.started] == list(range(LIMIT - 1))
        [child] = outcome.failed
        assert isinstance(child.error, Failure) and child.error.code == "busy" and child.index == LIMIT - 1
        assert f"child {LIMIT - 1} (busy)" in str(raised.value)
        assert [s["id"] for s in parent.api.sandboxes()] == [parent.sandbox_id]  # the started ones were killed

        second = Sandbox("base", url=daemon)
        try:
            with pytest.raises(RateLimitException, match="max_sandboxes") as refused:
                Sandbox("base", url=daemon)
            assert refused.value.code == "busy"

            async def create_async() -> None:
                await AsyncSandbox.create("base", url=daemon)

            with pytest.raises(RateLimitException, match="max_sandboxes"):
                asyncio.run(create_async())
        finally:
            second.kill()
    finally:
        parent.kill()


def test_mcp_spawn_reports_the_failed_child_beside_the_started_ones(daemon: str) -> None:
    async def spawn(count: int) -> tuple[object, str, bool]:
        async with AsyncController(url=daemon) as controller:
            async with Client(build_server(controller)) as client:
                result = await client.call_tool("spawn", {"snapshot_tag": "base", "count": count})
        text = "".join(getattr(block, "text", "") for block in result.content)
        return result.structured_content, text, bool(result.is_error)

    structured, _, is_error = anyio.run(spawn, LIMIT + 1)
    assert not is_error and isinstance(structured, dict)
    assert len(structured["sandboxes"]) == LIMIT
    [error] = structured["errors"]
    _is_refused(error, LIMIT)

    _, text, is_error = anyio.run(spawn, 1)  # every slot is taken: no child starts
    assert is_error and "no sandbox started: busy:" in text, text
    with Controller(url=daemon) as controller:
        _kill_all(controller)
