"""The REST boundary with a real runtime and registry (no VM is started by these requests)."""

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from forkd.config import Paths
from forkd.daemon.app import create_app
from forkd.runtime.runtime import Runtime
from forkd.vmm.qemu import QemuVmm


@pytest.fixture
def api(tmp_path: Path) -> TestClient:
    paths = Paths(home=tmp_path / "home", cache=tmp_path / "cache", socket=tmp_path / "forkd.sock")
    runtime = asyncio.run(Runtime.open(paths, QemuVmm(accelerator="tcg")))
    return TestClient(create_app(runtime), raise_server_exceptions=False)


@pytest.mark.parametrize("tag", ["../etc", "a/b", "", "x" * 65, "white space"])
def test_bad_tags_are_refused_with_json_errors(api: TestClient, tag: str) -> None:
    response = api.post("/v1/sandboxes", json={"snapshot_tag": tag, "n": 1})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert api.post("/v1/snapshots", json={"tag": tag}).status_code == 400


@pytest.mark.parametrize("body", [{"snapshot_tag": "ok", "n": 0}, {"snapshot_tag": "ok", "n": 1001},
                                  {"snapshot_tag": "ok", "n": True}, {"snapshot_tag": "ok", "extra": 1}, []])
def test_counts_and_shapes_are_bounded(api: TestClient, body: object) -> None:
    assert api.post("/v1/sandboxes", json=body).status_code == 400


def test_unknown_snapshot_and_sandbox(api: TestClient) -> None:
    response = api.post("/v1/sandboxes", json={"snapshot_tag": "missing", "n": 1})
    assert response.status_code == 400 and "forkd snapshot create" in response.json()["error"]["message"]
    assert api.get("/v1/sandboxes/sb-000000000000").status_code == 404
    assert api.get("/v1/sandboxes/not-an-id").status_code == 400
    assert api.post("/v1/sandboxes/sb-000000000000/eval", json={"expr": "1"}).status_code == 404
    assert api.get("/v1/snapshots/missing").status_code == 404


def test_exec_needs_exactly_one_command_form(api: TestClient) -> None:
    for body in ({}, {"cmd": "ls", "argv": ["ls"]}, {"argv": []}, {"cmd": "ls", "timeout_s": -1}):
        assert api.post("/v1/sandboxes/sb-000000000000/exec", json=body).status_code == 400


def test_contexts_of_a_missing_sandbox_and_bad_bodies(api: TestClient) -> None:
    base = "/v1/sandboxes/sb-000000000000/contexts"
    assert api.get(base).status_code == 404
    assert api.post(base, json={"language": "r"}).status_code == 400
    assert api.post(base, json={"id": "../x"}).status_code == 400
    assert api.post(f"{base}/bad id/restart").status_code == 400


def test_warm_exec_splits_a_shell_string_and_refuses_what_cannot_split() -> None:
    from forkd.daemon.schemas import ExecRequest
    body = ExecRequest(cmd="python3 -m pytest -k 'a and b'", warm=True)
    assert (body.argv, body.cmd) == (["python3", "-m", "pytest", "-k", "a and b"], None)
    assert ExecRequest(cmd="echo hi").cmd == "echo hi"  # not warm: a shell string stays one
    for cmd in ("python3 -c 'unclosed", "   "):
        with pytest.raises(ValueError):
            ExecRequest(cmd=cmd, warm=True)


def test_health_version_and_listing(api: TestClient) -> None:
    assert api.get("/healthz").json() == {"ok": True}
    version = api.get("/v1/version").json()
    assert version["accelerator"] == "tcg" and version["vmm"] == "qemu"
    assert api.get("/v1/sandboxes").json() == {"sandboxes": []}
    assert api.get("/v1/snapshots").json() == {"snapshots": []}
    assert api.get("/openapi.json").json()["paths"]["/v1/sandboxes"]


def test_every_error_has_the_documented_body(api: TestClient) -> None:
    """Malformed JSON, unknown routes and methods answer {"error": {code, message}}, never {"detail": ...}."""
    malformed = api.post("/v1/sandboxes", content=b'{"snapshot_tag": ', headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "malformed_body"
    for answer, status in ((api.get("/v1/nothing-here"), 404), (api.put("/v1/sandboxes"), 405)):
        assert answer.status_code == status and set(answer.json()["error"]) == {"code", "message"}, answer.text


@pytest.mark.parametrize("body", [{"expr": "1", "timeout_s": 5e-324}, {"expr": "1", "timeout_s": 0.5},
                                  {"expr": "1", "timeout_s": 1e300}])
def test_numbers_are_bounded_both_ways(api: TestClient, body: dict[str, object]) -> None:
    answer = api.post("/v1/sandboxes/sb-000000000000/eval", json=body)
    assert answer.status_code == 400 and "timeout_s" in answer.json()["error"]["message"]
    nan = api.post("/v1/sandboxes/sb-000000000000/eval", content=b'{"expr": "1", "timeout_s": NaN}',
                   headers={"content-type": "application/json"})
    assert nan.status_code == 400


def test_every_numeric_field_of_the_schema_has_both_bounds(api: TestClient) -> None:
    document = api.get("/openapi.json").json()
    unbounded = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number") and not where.endswith(("Outcome", "Use", "Entry", "Usage")) \
                    and ("minimum" not in node and "exclusiveMinimum" not in node or "maximum" not in node):
                unbounded.append(where)
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    for name, schema in document["components"]["schemas"].items():
        if not name.endswith(("Outcome", "Use", "Entry", "Usage", "Snapshot", "Sandbox", "ForkResult")):
            walk(schema, name)
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for parameter in operation.get("parameters", []):
                walk(parameter["schema"], f"{method} {path} {parameter['name']}")
    assert not unbounded, unbounded


def test_a_sandbox_that_ended_mid_call_is_a_409(api: TestClient) -> None:
    from forkd.daemon.errors import HANDLED_ERRORS, error_body
    from forkd.runtime.sandboxes import SandboxEnded
    assert any(issubclass(SandboxEnded, cls) for cls in HANDLED_ERRORS)
    status, body = error_body(SandboxEnded("sandbox sb-x ended while the call ran"))
    assert status == 409 and body["error"]["code"] == "sandbox_ended"


def _subclasses(cls: type) -> list[type]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


def test_every_exception_carries_a_kind_of_the_one_table() -> None:
    """Each class declares its kind (``forkd.errors.kind_for`` reads it); a code outside the table would be
    answered as internal, so every declared one must be in it, and the specific classes keep their own."""
    from forkd.daemon.errors import HANDLED_ERRORS
    from forkd.errors import KINDS, kind_for
    from forkd.image.errors import ImageNotFound
    from forkd.runtime.agent_client import AgentError, AgentUnavailable
    from forkd.runtime.branches import BranchBusy
    from forkd.runtime.isolation import IsolationError
    from forkd.runtime.sandboxes import SandboxNotFound
    from forkd.runtime.spawning import DeadlinePassed, SandboxLimitReached
    from forkd.packs.peer import PeerError
    from forkd.runtime.driver_forks import IdempotencyConflict
    from forkd.store.errors import DigestNotFound, SnapshotCorrupt, SnapshotDiskFull
    from forkd.vmm.base import SnapshotMismatch

    declared = {cls for base in (*HANDLED_ERRORS, IsolationError, SandboxLimitReached, DeadlinePassed)
                for cls in _subclasses(base) if isinstance(getattr(cls, "kind", None), str)}
    assert len(declared) > 15
    assert all(cls.kind in KINDS for cls in declared), [cls for cls in declared if cls.kind not in KINDS]
    expected = {ImageNotFound("x"): "not_found", BranchBusy("x"): "busy", SnapshotCorrupt("x"): "snapshot_corrupt",
                SnapshotDiskFull("x"): "disk_full", SnapshotMismatch("x"): "snapshot_mismatch",
                SandboxNotFound("x"): "not_found", SandboxLimitReached("x"): "busy", DeadlinePassed("x"): "timeout",
                AgentUnavailable("x"): "agent_unavailable", AgentError("os_error", "x"): "os_error",
                DigestNotFound("x"): "snapshot_not_found", PeerError("x"): "peer_error",
                IdempotencyConflict("x"): "idempotency_conflict", LookupError("x"): "not_found",
                ValueError("x"): "internal"}
    assert {type(exc).__name__: kind_for(exc).code for exc in expected} == \
        {type(exc).__name__: code for exc, code in expected.items()}
