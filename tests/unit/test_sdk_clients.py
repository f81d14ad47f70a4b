"""The SDK's clients without VMs: the sync and async controllers send the same requests (one set of
builders), read NDJSON the same way, map the real daemon's errors, and report forks per child."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from forkd.config import Paths
from forkd.errors import Failure
from forkd.daemon.app import create_app
from forkd.runtime.runtime import Runtime
from forkd.sdk.async_controller import AsyncController
from forkd.sdk.sandbox_async import AsyncSandbox
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.controller import Controller
from forkd.sdk.errors import ForkdError, InvalidArgumentException, NotFoundException
from forkd.sdk.models import CommandExitException, ForkFailed, ForkOutcome
from forkd.sdk.calls import Call
from forkd.sdk.sandbox_sync import Sandbox
from forkd.vmm.qemu import QemuVmm

BASE = "http://forkd"
MISSING = "sb-000000000000"
Handler = Callable[[httpx.Request], httpx.Response]


def clients(handler: Handler) -> tuple[Controller, AsyncController]:
    transport = httpx.MockTransport(handler)
    return (Controller(url=BASE, http=httpx.Client(transport=transport, base_url=BASE)),
            AsyncController(url=BASE, http=httpx.AsyncClient(transport=transport, base_url=BASE)))


def ndjson(*lines: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, content=b"".join(json.dumps(line).encode() + b"\n" for line in lines),
                          headers={"content-type": "application/x-ndjson"})


def test_connection_config_reads_the_environment_once_and_keywords_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_URL", "https://daemon.example:8443")
    monkeypatch.setenv("FORKD_TOKEN", "t0ken")
    monkeypatch.setenv("FORKD_CA_CERT", "/nonexistent/ca.pem")
    config = ConnectionConfig.from_env()
    assert (config.url, config.token, config.ca_cert, config.socket) == (
        "https://daemon.example:8443", "t0ken", "/nonexistent/ca.pem", None)
    override = ConnectionConfig.resolve(config, url="unix:///run/forkd.sock")
    assert (override.url, override.token, override.socket) == ("unix:///run/forkd.sock", "t0ken", "/run/forkd.sock")
    with Controller(url="http://other:1", token="x", timeout=5) as controller:
        assert (controller.connection.url, controller.connection.token, controller.connection.request_timeout) == (
            "http://other:1", "x", 5)
    with pytest.raises(InvalidArgumentException, match="unix://, http:// or https://"):
        ConnectionConfig(url="ftp://nope")
    with pytest.raises(InvalidArgumentException, match="request_timeout"):
        ConnectionConfig(url=BASE, request_timeout=0)


def test_both_controllers_send_the_same_requests() -> None:
    seen: list[tuple[str, str, str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, str(request.url.query), request.read()))
        if request.url.path.endswith("/timeout"):
            return httpx.Response(200, json={"end_at": 12.5})
        if request.url.path == "/v1/sandboxes" and request.method == "GET":
            return httpx.Response(200, json={"sandboxes": []})
        if request.url.path == "/v1/sandboxes" and request.method == "DELETE":
            return httpx.Response(200, json={"killed": ["sb-000000000001"]})
        return httpx.Response(200, json={"removed_tags": ["a"], "ok": True})

    sync, asynchronous = clients(handler)
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("fork", ("t", 2), {"timeout_s": 30, "envs": {"A": "1"}}),
        ("exec", (MISSING, ["ls", "-l"]), {"cwd": "/tmp", "warm": True}),
        ("run_code", (MISSING, "1 + 1"), {"timeout_s": 5}),
        ("set_timeout", (MISSING, 60), {}),
        ("remove_snapshot", ("t",), {"cascade": True}),
        ("write_file", (MISSING, "/root/x", b"\x00\x01"), {"mode": 0o600}),
        ("rename", (MISSING, "/a", "/b"), {}),
        ("sandboxes", (), {}),
        ("fork", (None, 1), {"snapshot_digest": "d" * 64, "idempotency_key": "job:1", "owner": "job"}),
        ("sandboxes", (), {"owner": "job"}),
        ("kill_owner", ("job",), {}),
        ("node_pull", ("d" * 64, "http://peer:7000", "secret"), {}),
    ]
    sync_answers = [getattr(sync, name)(*args, **kwargs) for name, args, kwargs in calls]
    sync_seen, seen[:] = list(seen), []

    async def run_async() -> list[Any]:
        return [await getattr(asynchronous, name)(*args, **kwargs) for name, args, kwargs in calls]

    assert asyncio.run(run_async()) == sync_answers
    assert seen == sync_seen
    assert sync_answers[3] == 12.5 and sync_answers[4] == ["a"] and sync_answers[6] is None
    assert sync_seen[0][:2] == ("POST", "/v1/sandboxes") and json.loads(sync_seen[0][3]) == {
        "snapshot_tag": "t", "n": 2, "timeout_s": 30, "envs": {"A": "1"}}
    assert json.loads(sync_seen[8][3]) == {"n": 1, "snapshot_digest": "d" * 64, "idempotency_key": "job:1",
                                           "owner": "job"}
    assert sync_seen[9][:3] == ("GET", "/v1/sandboxes", "b'owner=job'")
    assert sync_seen[10][:3] == ("DELETE", "/v1/sandboxes", "b'owner=job'") and sync_answers[10] == ["sb-000000000001"]
    assert sync_seen[11][:2] == ("POST", "/v1/node/pull") and json.loads(sync_seen[11][3]) == {
        "digest": "d" * 64, "source": "http://peer:7000", "source_token": "secret"}
    with pytest.raises(TypeError, match="unknown fork options"):
        sync.fork_iter("t", 1, colour="red").__next__()


def test_ndjson_results_errors_and_truncation_read_alike() -> None:
    answers = {"/ok": [{"progress": "one"}, {"progress": "two"}, {"result": {"tag": "t"}}],
               "/err": [{"progress": "one"}, {"error": {"code": "not_found", "message": "gone"}}],
               "/cut": [{"progress": "one"}]}
    sync, asynchronous = clients(lambda request: ndjson(*answers[request.url.path]))
    lines: list[str] = []
    assert sync._stream(Call("POST", "/ok"), lambda line: lines.append(line["progress"])) == {"tag": "t"}

    async def collect(line: dict[str, Any]) -> None:
        lines.append(line["progress"])

    assert asyncio.run(asynchronous._stream(Call("POST", "/ok"), collect)) == {"tag": "t"}
    assert lines == ["one", "two", "one", "two"]
    for path, error in (("/err", NotFoundException), ("/cut", ForkdError)):
        with pytest.raises(error) as raised:
            sync._stream(Call("POST", path), None)
        with pytest.raises(error) as raised_async:
            asyncio.run(asynchronous._stream(Call("POST", path), None))
        assert raised.value.code == raised_async.value.code == ("not_found" if path == "/err" else "truncated")


@pytest.fixture
def app(tmp_path: Path) -> Any:
    paths = Paths(home=tmp_path / "home", cache=tmp_path / "cache", socket=tmp_path / "forkd.sock")
    return create_app(asyncio.run(Runtime.open(paths, QemuVmm(accelerator="tcg"))))


def test_async_sandbox_against_the_real_daemon_app(app: Any) -> None:
    async def scenario() -> None:
        api = AsyncController(url=BASE, http=httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=BASE))
        assert await api.health() == {"ok": True}
        assert await api.sandboxes() == []
        with pytest.raises(InvalidArgumentException, match="forkd snapshot create"):
            await api.fork("missing")
        with pytest.raises(InvalidArgumentException):
            [child async for child in api.fork_iter("missing", 2)]
        sandbox = AsyncSandbox(MISSING, api)
        assert not await sandbox.is_running() and not await sandbox.kill()
        for call in (sandbox.commands.run("true"), sandbox.files.read("/etc/hostname"), sandbox.eval("1"),
                     sandbox.run_code("1", on_stdout=print), sandbox.files.write("/x", b"1"),
                     sandbox.get_info()):
            with pytest.raises(NotFoundException):
                await call
        assert not await sandbox.files.exists("/etc")
        await api.close()

    asyncio.run(scenario())


def test_sync_controller_against_the_real_daemon_app(app: Any) -> None:
    with Controller(url=BASE, http=TestClient(app, base_url=BASE)) as controller:
        assert controller.sandboxes() == [] and controller.snapshots() == []
        with pytest.raises(NotFoundException):
            controller.read_file(MISSING, "/etc/hostname")
        with pytest.raises(InvalidArgumentException):
            list(controller.fork_iter("missing"))


def exec_answer(exit_code: int) -> httpx.Response:
    return ndjson({"event": "started", "pid": 7}, {"event": "stdout", "data": "hi\n"},
                  {"event": "stderr", "data": "warn\n"},
                  {"result": {"exit_code": exit_code, "timed_out": False, "duration_s": 0.1}})


def test_async_commands_stream_output_to_coroutine_callbacks() -> None:
    codes = iter([0, 3])
    _, api = clients(lambda request: exec_answer(next(codes)))
    sandbox = AsyncSandbox(MISSING, api)
    heard: list[str] = []

    async def on_stdout(text: str) -> None:
        heard.append(text)

    async def scenario() -> None:
        result = await sandbox.commands.run("echo hi", on_stdout=on_stdout, on_stderr=heard.append)
        assert (result.stdout, result.stderr, result.exit_code) == ("hi\n", "warn\n", 0)
        with pytest.raises(CommandExitException) as failed:
            await sandbox.commands.run("exit 3")
        assert (failed.value.exit_code, failed.value.stdout) == (3, "hi\n")

    asyncio.run(scenario())
    assert heard == ["hi\n", "warn\n"]


def fork_handler(killed: list[str]) -> Handler:
    """A daemon whose BRANCH works and whose fork starts child 1 but not child 0."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/branch"):
            return httpx.Response(200, json={"tag": json.loads(request.read())["tag"]})
        if request.method == "DELETE":
            killed.append(request.url.path.rsplit("/", 1)[-1])
            return httpx.Response(200, json={})
        assert json.loads(request.read())["stream"] is True
        return ndjson({"child": {"index": 1, "sandbox": {"id": "sb-111111111111"}, "timings": {"restore": 0.2}}},
                      {"child": {"index": 0, "error": {"code": "vmm_error", "message": "out of memory"},
                                 "timings": {}}},
                      {"result": {"sandboxes": [], "errors": []}})

    return handler


def test_fork_reports_each_child_and_kills_the_started_ones_on_failure() -> None:
    killed: list[str] = []
    sync, asynchronous = clients(fork_handler(killed))
    parent = Sandbox._attach(MISSING)
    parent._api = sync
    with pytest.raises(ForkFailed) as failed:
        parent.fork(2)
    with pytest.raises(ForkFailed) as failed_async:
        asyncio.run(AsyncSandbox(MISSING, asynchronous).fork(2))
    for outcome in (failed.value.outcome, failed_async.value.outcome):
        assert [(c.index, c.sandbox_id, c.error) for c in outcome.children] == [
            (0, None, Failure("vmm_error", "out of memory")), (1, "sb-111111111111", None)]
        assert outcome.children[1].timings == {"restore": 0.2}
    assert killed == ["sb-111111111111", "sb-111111111111"]
    assert "child 0 (vmm_error): out of memory" in str(failed.value)


def test_fork_outcome_orders_children_and_splits_started_from_failed() -> None:
    """A bare string is how daemons before typed per-child errors reported one: it reads as internal."""
    outcome = ForkOutcome.from_children([{"index": 2, "sandbox": {"id": "sb-2"}, "timings": {}},
                                         {"index": 0, "error": "x"}, {"index": 1, "sandbox": {"id": "sb-1"}}])
    assert [c.index for c in outcome.children] == [0, 1, 2]
    assert [c.sandbox_id for c in outcome.started] == ["sb-1", "sb-2"]
    assert [c.error for c in outcome.failed] == [Failure("internal", "x")]
