"""Tenants and tokens on the E2B front, with the real front, runtime and registry over the FakeVmm:
owner separation on every control-plane route and the template list, a token on every sandbox
route, per-sandbox nonces, refused weak secrets, bounded bodies and messages."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from test_runtime_fake_vmm import _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.daemon.middleware.body_limit import BodyLimit
from forkd.e2b import app as e2b_app
from forkd.e2b import connect
from forkd.e2b.app import E2BFront
from forkd.e2b.errors import ConnectError
from forkd.e2b.keys import Credentials, CredentialsError, Principal
from forkd.e2b.process import MAX_STREAMS, STREAM_BUFFER_BYTES, _END, _Process
from forkd.e2b.sandboxes import NONCE_LABEL, OWNER_LABEL
from forkd.guest import protocol
from forkd.runtime.recovery import recover
from forkd.runtime.runtime import Runtime
from forkd.vmm.fake import FakeVmm

A, B, ADMIN = ("e2b_" + c * 40 for c in "abc")
KEYS = {A: Principal("team-a"), B: Principal("team-b"), ADMIN: Principal("ops", admin=True)}
SECRET = b"k" * 32


def _front(runtime: Runtime, **limits: Any) -> BodyLimit:
    return BodyLimit(E2BFront(runtime, Credentials(KEYS, SECRET)), is_upload=e2b_app.is_upload,
                     is_stream=e2b_app.is_stream, shape=e2b_app.refusal_shape, **limits)


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front")


def _key(key: str) -> dict[str, str]:
    return {"X-API-KEY": key}


def _to(sandbox: str, port: int, token: str | None = None, header: str = "X-Access-Token") -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox, "E2b-Sandbox-Port": str(port), **({header: token} if token else {})}


async def _ids(client: httpx.AsyncClient, key: str, path: str = "/v2/sandboxes") -> set[str]:
    answer = await client.get(path, headers=_key(key))
    assert answer.status_code == 200, answer.text
    return {s["sandboxID"] for s in answer.json()}


async def _templates(client: httpx.AsyncClient, key: str) -> set[str]:
    return {t["templateID"] for t in (await client.get("/templates", headers=_key(key))).json()}


async def _foreign_answers(client: httpx.AsyncClient, key: str, sandbox: str) -> dict[str, int]:
    """Every control-plane route on a sandbox the key's owner does not own: the status of each."""
    calls = {
        "get": client.get(f"/sandboxes/{sandbox}", headers=_key(key)),
        "timeout": client.post(f"/sandboxes/{sandbox}/timeout", headers=_key(key), json={"timeout": 60}),
        "connect": client.post(f"/sandboxes/{sandbox}/connect", headers=_key(key), json={"timeout": 60}),
        "connect-v2": client.post(f"/v2/sandboxes/{sandbox}/connect", headers=_key(key), json={"timeout": 60}),
        "resume": client.post(f"/sandboxes/{sandbox}/resume", headers=_key(key), json={"timeout": 60}),
        "pause": client.post(f"/sandboxes/{sandbox}/pause", headers=_key(key)),
        "fork": client.post(f"/sandboxes/{sandbox}/fork", headers=_key(key), json={"count": 1}),
        "token": client.post(f"/sandboxes/{sandbox}/token", headers=_key(key)),
        "kill": client.delete(f"/sandboxes/{sandbox}", headers=_key(key)),
    }
    return {name: (await call).status_code for name, call in calls.items()}


def test_each_owner_sees_and_controls_only_its_own_objects_and_ownership_outlives_pause_and_restart(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm)
        try:
            async with _client(_front(runtime)) as client:
                made = await client.post("/sandboxes", headers=_key(A), json={"templateID": "base", "timeout": 600})
                assert made.status_code == 201, made.text
                sa = made.json()["sandboxID"]
                assert made.json()["trafficAccessToken"] == made.json()["envdAccessToken"]
                (rest,) = await runtime.spawner.fork("base", 1)  # made through REST: no owner
                assert rest.sandbox is not None
                sr = rest.sandbox["id"]
                reserved = await client.post("/sandboxes", headers=_key(A),
                                             json={"templateID": "base", "metadata": {OWNER_LABEL: "team-b"}})
                assert reserved.status_code == 400 and "reserved" in reserved.json()["message"]

                for path in ("/sandboxes", "/v2/sandboxes"):
                    assert await _ids(client, A, path) == {sa}
                    assert await _ids(client, B, path) == set()
                    assert await _ids(client, ADMIN, path) == {sa, sr}
                assert set((await client.get(f"/sandboxes/{sa}", headers=_key(A))).json()["metadata"]) == set()
                assert await _foreign_answers(client, B, sa) == dict.fromkeys(
                    ("get", "timeout", "connect", "connect-v2", "resume", "pause", "fork", "token", "kill"), 404)
                assert set((await _foreign_answers(client, A, sr)).values()) == {404}  # REST-made: admin only

                forked = await client.post(f"/sandboxes/{sa}/fork", headers=_key(A), json={"count": 1})
                assert forked.status_code == 201, forked.text
                child = forked.json()[0]["sandbox"]
                fork_tag = child["templateID"]
                assert await _ids(client, A) == {sa, child["sandboxID"]}
                assert await _templates(client, A) == {"base", fork_tag}
                assert await _templates(client, B) == {"base"}
                assert fork_tag in await _templates(client, ADMIN)
                stolen = await client.post("/sandboxes", headers=_key(B), json={"templateID": fork_tag})
                assert stolen.status_code == 404

                assert (await client.post(f"/sandboxes/{sa}/pause", headers=_key(A))).status_code == 204
                assert await _ids(client, B) == set() and sa in await _ids(client, A)
                assert set((await _foreign_answers(client, B, sa)).values()) == {404}
                resumed = await client.post(f"/sandboxes/{sa}/connect", headers=_key(A), json={"timeout": 600})
                assert resumed.status_code == 201, resumed.text
                assert resumed.json()["envdAccessToken"] == made.json()["envdAccessToken"]  # same nonce after a resume

                # Rotation, running and paused: the old token stops working, the new one lasts.
                old = made.json()["envdAccessToken"]
                rotated = (await client.post(f"/sandboxes/{sa}/token", headers=_key(A))).json()["envdAccessToken"]
                assert rotated != old
                workspace = runtime.registry.get_workspace(sa)
                assert workspace is not None and workspace.sandbox_id is not None
                stored = runtime.registry.get_sandbox(workspace.sandbox_id)
                assert stored is not None  # the registry holds the new nonce, not only the live record:
                assert Credentials(KEYS, SECRET).access_token(sa, stored.meta["metadata"][NONCE_LABEL]) == rotated
                assert (await client.get("/contexts", headers=_to(sa, 49999, old))).status_code == 401
                assert (await client.post("/contexts", headers=_to(sa, 49999, rotated), json={})).status_code == 200
                assert (await client.post(f"/sandboxes/{sa}/pause", headers=_key(A))).status_code == 204
                again = (await client.post(f"/sandboxes/{sa}/token", headers=_key(A))).json()["envdAccessToken"]
                resumed = await client.post(f"/sandboxes/{sa}/connect", headers=_key(A), json={"timeout": 600})
                assert again not in (old, rotated) and resumed.json()["envdAccessToken"] == again
            # The daemon restarts: a new runtime adopts the running sandboxes, their owners with them.
            await runtime.sandboxes.detach_all()
            runtime.registry.close()
            restarted = await Runtime.open(runtime.paths, vmm)
            await recover(restarted.sandboxes, restarted.store)
            runtime = restarted
            async with _client(_front(restarted)) as client:
                assert await _ids(client, A) == {sa, child["sandboxID"]}
                assert await _ids(client, B) == set()
                assert (await client.delete(f"/sandboxes/{sa}", headers=_key(B))).status_code == 404
                described = (await client.get(f"/sandboxes/{sa}", headers=_key(A))).json()
                assert described["envdAccessToken"] == again  # the rotated nonce is in the registry
                assert (await client.delete(f"/sandboxes/{sa}", headers=_key(A))).status_code == 204
        finally:
            await runtime.stop()

    run(scenario)


SANDBOX_ROUTES = [  # (port, method, path, body) of every route the front serves on a sandbox
    (49983, "GET", "/files?path=/etc/hostname", None),
    (49983, "POST", "/files?path=/tmp/x", b"data"),
    (49983, "POST", "/process.Process/List", b"{}"),
    (49983, "POST", "/filesystem.Filesystem/Stat", b'{"path": "/"}'),
    (49999, "GET", "/health", None),
    (49999, "POST", "/execute", b'{"code": "1"}'),
    (49999, "GET", "/contexts", None),
    (49999, "POST", "/contexts", b"{}"),
    (49999, "POST", "/contexts/c1/restart", None),
    (49999, "DELETE", "/contexts/c1", None),
]


def test_every_sandbox_route_needs_that_sandboxs_token_and_a_recreated_name_gets_a_new_one(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm())
        try:
            async with _client(_front(runtime)) as client:
                mine = (await client.post("/sandboxes", headers=_key(A), json={"templateID": "base"})).json()
                other = (await client.post("/sandboxes", headers=_key(A), json={"templateID": "base"})).json()
                sandbox, token = mine["sandboxID"], mine["envdAccessToken"]
                for port, method, path, body in SANDBOX_ROUTES:
                    for given in (None, "0" * 64, other["envdAccessToken"]):
                        answer = await client.request(method, path, headers=_to(sandbox, port, given), content=body)
                        assert answer.status_code == 401, (port, method, path, given, answer.text)
                    both = {**_to(sandbox, port, token), "E2B-Traffic-Access-Token": "0" * 64}
                    assert (await client.request(method, path, headers=both, content=body)).status_code == 401
                # The SDKs send the context routes the traffic token only: that is enough.
                created = await client.post("/contexts", headers=_to(sandbox, 49999, mine["trafficAccessToken"],
                                                                     "E2B-Traffic-Access-Token"), json={})
                assert created.status_code == 200, created.text
                health = await client.get("/health", headers=_to(sandbox, 49983))  # envd's health stays open
                assert health.status_code == 204
                deep = b'{"path": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
                answer = await client.post("/filesystem.Filesystem/Stat", content=deep,
                                           headers={**_to(sandbox, 49983, token), "Content-Type": "application/json"})
                assert answer.status_code == 400 and answer.json()["code"] == "invalid_argument"

                first = await runtime.workspaces.create("notes", "base")  # made through REST, re-created below
                token_of = lambda: client.get("/sandboxes/notes", headers=_key(ADMIN))  # noqa: E731
                old = (await token_of()).json()["envdAccessToken"]
                await runtime.workspaces.remove(first.name)
                await runtime.workspaces.create("notes", "base")
                new = (await token_of()).json()["envdAccessToken"]
                assert new != old
                stale = await client.get("/contexts", headers=_to("notes", 49999, old))
                assert stale.status_code == 401
        finally:
            await runtime.stop()

    run(scenario)


def test_bodies_are_bounded_in_size_and_in_pauses(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm(), tag=None)
        app = _front(runtime, max_json_bytes=1 << 20, body_timeout_s=0.2)
        try:
            async with _client(app) as client:
                big = b'{"templateID": "' + b"x" * (2 << 20) + b'"}'
                for content in (big, _chunks(big)):  # declared, and found while reading (chunked)
                    answer = await client.post("/sandboxes", headers=_key(A), content=content)
                    assert answer.status_code == 413 and answer.json()["code"] == 413, answer.text
                answer = await client.post("/execute", headers=_to("sb-any", 49999, "0" * 64), content=big)
                assert answer.status_code == 413
            sent: list[dict[str, Any]] = []
            first = True

            async def stalled() -> dict[str, Any]:  # one chunk, then nothing
                nonlocal first
                if first:
                    first = False
                    return {"type": "http.request", "body": b'{"templ', "more_body": True}
                await asyncio.Event().wait()
                raise AssertionError("unreachable")

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": "/sandboxes", "headers": [(b"x-api-key", A.encode())],
                     "query_string": b"", "scheme": "http", "server": ("front", 80), "client": ("c", 1),
                     "http_version": "1.1", "root_path": ""}
            await app(scope, stalled, send)
            assert sent[0]["status"] == 408 and json.loads(sent[1]["body"])["code"] == 408
        finally:
            await runtime.stop()

    run(scenario)


async def _chunks(data: bytes) -> Any:
    for start in range(0, len(data), 64 << 10):
        yield data[start:start + (64 << 10)]


def test_a_secret_under_32_bytes_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{A} team-a\n{ADMIN} ops admin\n{B}\n")
    for weak in ("", "short-secret\n"):
        (tmp_path / "secret").write_text(weak)
        with pytest.raises(CredentialsError, match="at least 32"):
            Credentials.load(keys, tmp_path / "secret")
    (tmp_path / "secret").unlink()
    credentials = Credentials.load(keys, tmp_path / "secret")  # made on first use, strong
    assert credentials.principal(A) == Principal("team-a") and credentials.principal(ADMIN) == Principal("ops", True)
    assert credentials.principal(B) == Principal("default", True)  # a key line of the old format: admin


def test_a_stream_that_falls_behind_is_dropped_and_attachments_are_bounded() -> None:
    async def scenario() -> None:
        process = _Process(config={}, tag=None)
        stalled, reading = process.attach(), process.attach()
        chunk = {"event": {"data": {"stdout": "A" * (64 << 10)}}}
        for _ in range(2 * STREAM_BUFFER_BYTES // (64 << 10)):
            process.publish(chunk)
            while not reading.queue.empty():
                await reading.get()
        assert stalled not in process.streams and reading in process.streams
        assert stalled.bytes <= STREAM_BUFFER_BYTES
        items = [await stalled.get() for _ in range(stalled.queue.qsize())]
        assert isinstance(items[-1], ConnectError) and items[-1].code == "resource_exhausted"
        for _ in range(MAX_STREAMS - 1):
            process.attach()
        with pytest.raises(ConnectError, match="resource_exhausted"):
            process.attach()
        process.end = {}
        assert await process.attach().get() is _END

    asyncio.run(scenario())


def test_a_server_stream_is_refused_at_its_second_request_message(tmp_path: Path) -> None:
    """Not after collecting every envelope the client cares to send: the stream below never ends, so a
    server that collected first would answer 413 at the listener's body limit (or never), not invalid_argument.
    How many envelopes the client got out before the answer depends on scheduling, so it is not asserted."""
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm())

        async def endless() -> Any:
            while True:
                yield connect.envelope({"process": {"cmd": "/bin/true"}})
                await asyncio.sleep(0)  # as a network peer would, between its writes

        try:
            async with _client(_front(runtime)) as client:
                made = (await client.post("/sandboxes", headers=_key(A), json={"templateID": "base"})).json()
                headers = {**_to(made["sandboxID"], 49983, made["envdAccessToken"]),
                           "Content-Type": "application/connect+json"}
                answer = await client.post("/process.Process/Start", headers=headers, content=endless())
                end = json.loads(answer.content[5:])
                assert end["error"]["code"] == "invalid_argument"
        finally:
            await runtime.stop()

    run(scenario)
