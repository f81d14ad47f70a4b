"""docs/openapi.json as tools consume it: named, tagged operations with their own error lists and parameter
patterns, a bearer scheme; a client generated from it by openapi-python-client that imports and drives a
real daemon (fake backend); and ``Allow`` on every 405 that daemon answers."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import fake_daemon_on
from forkd.daemon.openapi import render
from forkd.sdk.controller import Controller
from forkd.validation import SANDBOX_ID_PATTERN, TAG_PATTERN

REPO = Path(__file__).resolve().parents[2]
GENERATOR = Path(sys.executable).with_name("openapi-python-client")


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return json.loads(render())


def _operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield method.upper(), path, operation


def test_operations_are_named_tagged_and_secured(document: dict[str, Any]) -> None:
    ids = [operation["operationId"] for _, _, operation in _operations(document)]
    assert len(ids) == len(set(ids)) > 40
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", name) and "_v1_" not in name for name in ids), ids
    tags = {tag["name"] for tag in document["tags"]}
    assert all(len(operation["tags"]) == 1 and operation["tags"][0] in tags for _, _, operation in _operations(document))
    assert document["paths"]["/v1/sandboxes/{sandbox_id}/files"]["get"]["operationId"] == "read_file"
    assert document["components"]["securitySchemes"]["bearer"] == {**document["components"]["securitySchemes"]["bearer"],
                                                                  "type": "http", "scheme": "bearer"}
    assert {"bearer": []} in document["security"]
    assert document["paths"]["/healthz"]["get"]["security"] == []


def test_path_parameters_declare_what_the_api_accepts(document: dict[str, Any]) -> None:
    expected = {"sandbox_id": SANDBOX_ID_PATTERN, "tag": TAG_PATTERN, "name": TAG_PATTERN}
    for method, path, operation in _operations(document):
        for parameter in operation.get("parameters", []):
            if parameter["in"] == "path" and parameter["name"] in expected:
                assert parameter["schema"]["pattern"] == expected[parameter["name"]], (method, path)


def test_errors_are_listed_per_route_and_raw_bodies_declared(document: dict[str, Any]) -> None:
    errors = {(method, path): {s for s in operation["responses"] if s.isdigit() and int(s) >= 400}
              for method, path, operation in _operations(document)}
    assert errors[("GET", "/healthz")] == {"500"}
    assert {"404", "409", "502", "504"} <= errors[("POST", "/v1/sandboxes/{sandbox_id}/exec")]
    assert "507" in errors[("POST", "/v1/sandboxes")] and "507" not in errors[("GET", "/v1/sandboxes")]
    assert len({frozenset(e) for e in errors.values()}) > 5  # not the same list on every route
    assert all("default" in operation["responses"] for _, _, operation in _operations(document))
    upload = document["paths"]["/v1/sandboxes/{sandbox_id}/files"]["put"]["requestBody"]
    assert upload["required"] and "application/octet-stream" in upload["content"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The client openapi-python-client generates from the repository's document, imported."""
    root = tmp_path_factory.mktemp("client")
    (root / "config.yaml").write_text("post_hooks: []\n")
    done = subprocess.run([str(GENERATOR), "generate", "--path", str(REPO / "docs" / "openapi.json"), "--meta", "none",
                           "--config", str(root / "config.yaml"), "--output-path", str(root / "forkd_client")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("forkd_client")
    finally:
        sys.path.remove(str(root))


def test_a_generated_client_drives_the_daemon(generated: Any, fake_home: Path) -> None:
    models = importlib.import_module("forkd_client.models")

    def operation(tag: str, name: str) -> Any:
        return importlib.import_module(f"forkd_client.api.{tag}.{name}")

    with fake_daemon_on(fake_home) as daemon:
        client = generated.Client(base_url="http://forkd",
                                  httpx_args={"transport": httpx.HTTPTransport(uds=str(fake_home / "forkd.sock"))})
        assert operation("system", "get_health").sync(client=client).ok is True
        daemon.create_snapshot("base", memory_mib=256, warm_modules=[])  # NDJSON progress: not a generated call

        listed = operation("snapshots", "list_snapshots").sync(client=client)
        assert [s.tag for s in listed.snapshots] == ["base"]
        described = operation("snapshots", "get_snapshot").sync("base", client=client)
        assert isinstance(described, models.DescribedSnapshot)
        assert described.disk.logical_bytes == listed.snapshots[0].disk.logical_bytes  # one meaning in both
        assert described.depth == 0 and described.chain_bytes == described.own_bytes

        forked = operation("sandboxes", "fork_sandboxes").sync(client=client, body=models.SandboxCreate(snapshot_tag="base", n=1))
        assert isinstance(forked, models.ForkResult) and forked.errors == []
        sandbox_id = forked.sandboxes[0].id
        ran = operation("commands", "exec_command").sync(sandbox_id, client=client, body=models.ExecRequest(argv=["true"]))
        assert isinstance(ran, models.CommandOutcome) and ran.exit_code == 0  # the fake guest's answer
        renewed = operation("sandboxes", "set_timeout").sync(sandbox_id, client=client,
                                                             body=models.TimeoutBody(timeout_s=600.0))
        assert renewed.additional_properties["end_at"] == daemon.sandbox(sandbox_id)["end_at"]
        operation("sandboxes", "kill_sandbox").sync(sandbox_id, client=client)
        assert operation("sandboxes", "get_sandbox").sync(sandbox_id, client=client).status == "killed"
        unknown = operation("sandboxes", "get_sandbox").sync_detailed("sb-000000000000", client=client)
        assert unknown.status_code == 404 and isinstance(unknown.parsed, models.ErrorBody)
        assert unknown.parsed.error.code == "not_found"
        client.get_httpx_client().close()


def test_a_405_names_every_method_of_the_path(fake_home: Path) -> None:
    with fake_daemon_on(fake_home) as daemon:
        assert isinstance(daemon, Controller)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(fake_home / "forkd.sock")),
                          base_url="http://forkd") as raw:
            for method, path, allowed in (("OPTIONS", "/v1/sandboxes/sb-000000000000", "DELETE, GET"),
                                          ("PATCH", "/v1/sandboxes", "DELETE, GET, POST"),
                                          ("OPTIONS", "/v1/sandboxes/sb-000000000000/files", "DELETE, GET, PUT"),
                                          ("PUT", "/healthz", "GET")):
                answer = raw.request(method, path)
                assert answer.status_code == 405 and answer.headers["allow"] == allowed, (method, path)
                assert answer.json()["error"]["code"] == "method_not_allowed"
