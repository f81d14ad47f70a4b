"""The E2B front's boundary with a real runtime and registry (no VM is started by these requests):
credentials, the Connect codec, routing by header and host name, E2B's error shapes (schemathesis
over the control plane's document runs against a whole daemon: test_e2b_openapi.py)."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from forkd.config import Paths
from forkd.e2b import connect
from forkd.e2b.app import E2BFront, sandbox_target
from forkd.e2b.errors import ConnectError
from forkd.e2b.keys import Credentials, KeyFileError, Principal, load_api_keys
from forkd.e2b.process import ProcessService, _Process
from forkd.runtime.runtime import Runtime
from forkd.vmm.qemu import QemuVmm

KEY = "e2b_" + "ab12" * 10
SECRET = b"s" * 32


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> E2BFront:
    root = tmp_path_factory.mktemp("e2b")
    runtime = asyncio.run(Runtime.open(Paths(home=root / "home", cache=root / "cache", socket=root / "sock"),
                                       QemuVmm(accelerator="tcg")))
    return E2BFront(runtime, Credentials({KEY: Principal("ops", admin=True)}, SECRET))


@pytest.fixture(scope="module")
def client(front: E2BFront) -> TestClient:
    return TestClient(front, raise_server_exceptions=False)


def test_key_file_is_made_private_with_one_key_and_bad_lines_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "e2b" / "api-keys"
    ((key, principal),) = load_api_keys(path).items()
    assert key.startswith("e2b_") and len(key) == 44 and path.stat().st_mode & 0o777 == 0o600
    assert principal == Principal("default", admin=True)
    assert load_api_keys(path) == {key: principal}  # made once, then read
    path.write_text(f"# comment\n{key}\nnot-a-key\n")
    with pytest.raises(KeyFileError, match=":3: not an E2B API key"):
        load_api_keys(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        load_api_keys(tmp_path / "absent", create=False)


def test_access_tokens_are_per_sandbox_and_checked() -> None:
    credentials = Credentials({KEY: Principal("team-a")}, SECRET)
    token = credentials.access_token("sb-one", "n1")
    assert credentials.access_token_valid("sb-one", "n1", token)
    assert not credentials.access_token_valid("sb-two", "n1", token)
    assert not credentials.access_token_valid("sb-one", "n2", token)  # a re-created name has a new nonce
    assert not credentials.access_token_valid("sb-one", "n1", None)
    assert credentials.principal(KEY) == Principal("team-a") and credentials.principal("e2b_" + "0" * 40) is None


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _messages(*parts: bytes) -> list[dict[str, object]]:
    return [m async for m in connect.read_envelopes(_chunks(*parts))]


def test_envelopes_split_anywhere_and_end_at_the_end_stream_frame() -> None:
    body = connect.envelope({"a": 1}) + connect.envelope({"b": 2}) + connect.end_stream()
    assert asyncio.run(_messages(*[body[i:i + 3] for i in range(0, len(body), 3)])) == [{"a": 1}, {"b": 2}]
    assert json.loads(connect.end_stream(ConnectError("not_found", "x"))[5:]) == \
        {"error": {"code": "not_found", "message": "x"}}


@pytest.mark.parametrize("body, code", [
    (struct.pack(">BI", 0, 10) + b"{}", "invalid_argument"),  # ends inside an envelope
    (struct.pack(">BI", 0, connect.MAX_MESSAGE_BYTES + 1), "resource_exhausted"),  # oversized, refused unread
    (struct.pack(">BI", 0x80, 2) + b"{}", "invalid_argument"),  # unknown flags
    (struct.pack(">BI", 1, 2) + b"{}", "unimplemented"),  # compressed
    (struct.pack(">BI", 0, 3) + b"[1]", "invalid_argument"),  # not an object
    (struct.pack(">BI", 0, 2) + b"{x", "invalid_argument"),  # not JSON
])
def test_malformed_envelopes_are_refused_with_connect_codes(body: bytes, code: str) -> None:
    with pytest.raises(ConnectError) as refused:
        asyncio.run(_messages(body))
    assert refused.value.code == code


def test_sandbox_traffic_is_routed_by_headers_or_host_name() -> None:
    assert sandbox_target({"headers": [(b"e2b-sandbox-id", b"sb-a"), (b"e2b-sandbox-port", b"49983")]}) == \
        ("sb-a", "49983")
    assert sandbox_target({"headers": [(b"host", b"49999-sb-abc.e2b.local:3000")]}) == ("sb-abc", "49999")
    assert sandbox_target({"headers": [(b"host", b"127.0.0.1:3000")]}) is None


def test_control_plane_needs_the_api_key(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    for headers in ({}, {"X-API-KEY": "e2b_" + "0" * 40}):
        answer = client.get("/v2/sandboxes", headers=headers)
        assert answer.status_code == 401 and answer.json()["code"] == 401
    answer = client.get("/v2/sandboxes", headers={"X-API-KEY": KEY})
    assert answer.status_code == 200 and answer.json() == []


def test_control_plane_errors_are_e2b_shaped(client: TestClient) -> None:
    key = {"X-API-KEY": KEY}
    assert client.get("/sandboxes/sb-nothere0000", headers=key).json()["code"] == 404
    created = client.post("/sandboxes", headers=key, json={"templateID": "no-such-snapshot"})
    assert created.status_code == 404 and "forkd snapshots" in created.json()["message"]
    bad = client.post("/sandboxes", headers=key, json={"templateID": "x", "timeout": -1})
    assert bad.status_code == 400 and set(bad.json()) == {"code", "message"}
    unknown = client.get("/no/such/route", headers=key)  # never 404: the SDKs read that as "sandbox not found"
    assert unknown.status_code == 501 and "not supported by this server" in unknown.json()["message"]


def _sandbox_headers(port: str, token: str | None = None, sandbox: str = "sb-nothere0000") -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": sandbox, "E2b-Sandbox-Port": port}
    if token is not None:
        headers["X-Access-Token"] = token
    return headers


def test_sandbox_traffic_needs_its_token_and_a_gone_sandbox_is_not_found(client: TestClient, front: E2BFront) -> None:
    rpc = "/process.Process/List"
    missing = client.post(rpc, headers=_sandbox_headers("49983"), json={})
    assert missing.status_code == 401 and missing.json()["code"] == "unauthenticated"
    gone = client.post(rpc, headers=_sandbox_headers("49983", "0" * 64), json={})
    assert gone.status_code == 502 and "was not found" in gone.json()["message"]
    for port in ("8080", "3000"):  # any port is served now (tests/unit/test_e2b_port_relay.py): a gone sandbox is gone
        answer = client.get("/", headers=_sandbox_headers(port, "0" * 64))
        assert answer.status_code == 502 and "was not found" in answer.json()["message"]
    for port in ("0", "65536", "http"):
        answer = client.get("/", headers=_sandbox_headers(port, "0" * 64))
        assert answer.status_code == 502 and f"port {port} is not open" in answer.json()["message"]
    execute = client.post("/execute", headers=_sandbox_headers("49999"), json={"code": "1"})
    assert execute.status_code == 401


def test_a_slow_process_start_is_still_the_first_message_of_its_stream() -> None:
    """E2B's SDKs read the first message of a Start stream as the start event; a loaded guest can take
    longer than a keepalive interval to start the process."""
    async def main() -> None:
        process = _Process(config={}, tag=None)
        call = SimpleNamespace(request=SimpleNamespace(headers={"keepalive-ping-interval": "1"}))
        stream = ProcessService(None)._stream(process, process.attach(), call)  # type: ignore[arg-type]
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(1.5)  # a keepalive interval passes before the guest reports the start
        process.publish({"event": {"start": {"pid": 7}}})
        assert await asyncio.wait_for(first, 10) == {"event": {"start": {"pid": 7}}}
        assert await asyncio.wait_for(anext(stream), 10) == {"event": {"keepalive": {}}}  # from now on
        await stream.aclose()

    asyncio.run(main())
