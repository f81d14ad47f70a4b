"""``Sandbox`` and ``AsyncSandbox`` are one core (``forkd.sdk.sandbox``) run two ways: the same scenario,
itself a step generator, runs through both flavours against the same in-memory daemon and must see
the same answers. The daemon is an ``httpx.MockTransport`` handler speaking the REST API's shapes."""

from __future__ import annotations

import asyncio
import io
import json
import posixpath
from typing import Any

import httpx
import pytest

from forkd.sdk.async_controller import ASYNC, AsyncController
from forkd.sdk.controller import SYNC, Controller
from forkd.sdk.errors import NotFoundException
from forkd.sdk.models import CommandExitException, EntryInfo
from forkd.sdk.sandbox.flavour import Steps
from forkd.sdk.sandbox_async import AsyncSandbox
from forkd.sdk.sandbox_sync import Sandbox

BASE = "http://forkd.test"
SANDBOX = "sb-000000000001"


def _ndjson(*lines: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, content=b"".join(json.dumps(line).encode() + b"\n" for line in lines),
                          headers={"content-type": "application/x-ndjson"})


def _missing(what: str) -> httpx.Response:
    return httpx.Response(404, json={"error": {"code": "not_found", "message": f"no such {what}"}})


class Daemon:
    """Files, commands and cells of one sandbox, kept in memory."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {"/"}
        self.alive = True

    def entry(self, path: str) -> dict[str, Any]:
        kind = "dir" if path in self.dirs else "file"
        return {"name": posixpath.basename(path), "type": kind, "path": path,
                "size": len(self.files.get(path, b"")), "mode": 0o755 if kind == "dir" else 0o644, "mtime": 0}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        prefix = f"/v1/sandboxes/{SANDBOX}"
        route = request.url.path.removeprefix(prefix)
        path = request.url.params.get("path", "")
        body = json.loads(request.read() or b"null") if request.method != "PUT" else None
        if not self.alive and route == "/ping":  # the moment a killed VM stops: the agent is gone first
            return httpx.Response(502, json={"error": {"code": "agent_unavailable", "message": "agent gone"}})
        if not self.alive or not request.url.path.startswith(prefix):
            return _missing("sandbox")
        if (request.method, route) == ("PUT", "/files"):
            self.files[path] = request.read()
            return httpx.Response(200, json={"path": path, "size": len(self.files[path])})
        if (request.method, route) == ("GET", "/files"):
            return httpx.Response(200, content=self.files[path]) if path in self.files else _missing("file")
        if route == "/files/stat":
            return httpx.Response(200, json=self.entry(path)) if path in self.files or path in self.dirs \
                else _missing("file")
        if route == "/files/list":
            children = sorted(p for p in (*self.files, *self.dirs) if p != path and posixpath.dirname(p) == path)
            return httpx.Response(200, json={"entries": [self.entry(p) for p in children]})
        if route == "/files/mkdir":
            self.dirs.add(body["path"])
            return httpx.Response(200, json={})
        if route == "/files/rename":
            self.files[body["dst"]] = self.files.pop(body["src"])
            return httpx.Response(200, json={})
        if route == "/exec":
            code = 3 if "fail" in body["cmd"] else 0
            return _ndjson({"event": "started", "pid": 7}, {"event": "stdout", "data": f"ran {body['cmd']}\n"},
                           {"event": "stderr", "data": "warn\n"},
                           {"result": {"exit_code": code, "timed_out": False, "duration_s": 0.1}})
        if route == "/run_code":
            return _ndjson({"event": "stdout", "data": "printed\n"},
                           {"result": {"results": [{"text": "2", "is_main_result": True}], "value_json": 2}})
        if route == "/eval":
            return httpx.Response(200, json={"value": "[1, 2]", "value_json": [1, 2]})
        if route == "/contexts":
            return httpx.Response(200, json={"id": "c1", "language": "python", "cwd": body.get("cwd")})
        if (request.method, route) == ("DELETE", ""):
            self.alive = False
            return httpx.Response(200, json={})
        if route == "/ping":
            return httpx.Response(200, json={"ok": True})
        return httpx.Response(404, json={"error": {"code": "no_route", "message": route}})


def scenario(sandbox: Any) -> Steps[list[Any]]:
    """What both flavours must answer alike; each daemon call or callback is yielded to the flavour."""
    heard: list[str] = []
    seen: list[Any] = []
    seen.append((yield sandbox.files.write("/d", b"")).path)
    assert (yield sandbox.files.make_dir("/dir")) is True
    assert (yield sandbox.files.make_dir("/dir")) is False
    yield sandbox.files.write("/dir/a.txt", "hello")
    yield sandbox.files.write("/dir/big.bin", io.BytesIO(b"x" * 3_000_000))  # uploaded in pieces
    yield sandbox.files.write_files([{"path": "/dir/b.txt", "data": "b"}])
    seen.append((yield sandbox.files.read("/dir/a.txt")))
    seen.append((yield sandbox.files.read("/dir/big.bin", format="bytes"))[:2])
    seen.append([e.path for e in (yield sandbox.files.list("/", depth=2))])
    seen.append((yield sandbox.files.rename("/dir/b.txt", "/dir/c.txt")).path)
    seen.append((yield sandbox.files.exists("/dir/b.txt")))
    assert isinstance((yield sandbox.files.get_info("/dir/c.txt")), EntryInfo)
    result = yield sandbox.commands.run("echo", on_stdout=heard.append, on_stderr=heard.append)
    seen.append((result.stdout, result.stderr, result.exit_code))
    handle = yield sandbox.commands.run("sleep", background=True)
    seen.append((handle.pid, (yield handle.wait()).stdout))
    try:
        yield sandbox.commands.run("fail")
    except CommandExitException as exc:
        seen.append(exc.exit_code)
    execution = yield sandbox.run_code("1 + 1", on_stdout=lambda out: heard.append(out.line))
    seen.append((execution.text, execution.logs.stdout))
    seen.append((yield sandbox.eval("[1, 2]")))
    seen.append((yield sandbox.create_code_context(cwd="/tmp")).cwd)
    seen.append((yield sandbox.is_running()))
    seen.append((yield sandbox.kill()))
    seen.append(((yield sandbox.is_running()), (yield sandbox.kill())))
    try:
        yield sandbox.files.read("/dir/a.txt")
    except NotFoundException:
        seen.append("gone")
    return [*seen, heard]


EXPECTED = ["/d", "hello", bytearray(b"xx"), ["/d", "/dir", "/dir/a.txt", "/dir/b.txt", "/dir/big.bin"],
            "/dir/c.txt", False, ("ran echo\n", "warn\n", 0), (7, "ran sleep\n"), 3, ("2", ["printed\n"]), [1, 2],
            "/tmp", True, True, (False, False), "gone", ["ran echo\n", "warn\n", "printed\n"]]


def test_both_flavours_answer_the_same_scenario_alike() -> None:
    transport = httpx.MockTransport(Daemon())
    sync = Sandbox._attach(SANDBOX)
    sync._api = Controller(url=BASE, http=httpx.Client(transport=transport, base_url=BASE))
    assert SYNC.run(scenario(sync)) == EXPECTED

    transport = httpx.MockTransport(Daemon())

    async def run_async() -> list[Any]:
        api = AsyncController(url=BASE, http=httpx.AsyncClient(transport=transport, base_url=BASE))
        async with AsyncSandbox(SANDBOX, api) as sandbox:
            return await ASYNC.run(scenario(sandbox))

    assert asyncio.run(run_async()) == EXPECTED


def test_an_error_inside_async_steps_reaches_their_own_handler_and_cleanup() -> None:
    """The async flavour throws an awaited call's error back in where it was yielded: the steps'
    ``except`` sees it, and an error they do not handle propagates after their ``finally`` ran."""
    ran: list[str] = []

    async def fails() -> None:
        raise NotFoundException(404, "not_found", "gone")

    def steps() -> Steps[str]:
        try:
            yield fails()
        except NotFoundException:
            ran.append("handled")
        try:
            yield fails()
        finally:
            ran.append("cleaned up")
        return "unreachable"

    with pytest.raises(NotFoundException):
        asyncio.run(ASYNC.run(steps()))
    assert ran == ["handled", "cleaned up"]
