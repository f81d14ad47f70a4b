"""The API contract: the repository's docs/openapi.json is what the daemon serves, and the daemon keeps it.

Schemathesis generates requests from the served document (valid and invalid) against the real app
and runtime; no answer may be a 5xx or fail to match the documented schema.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from fastapi.testclient import TestClient

from openapi_checks import assert_not_refused_at_the_boundary
from forkd.config import Paths
from forkd.daemon.app import create_app
from forkd.daemon.openapi import render
from forkd.runtime.runtime import Runtime
from forkd.vmm.qemu import QemuVmm

REPO = Path(__file__).resolve().parents[2]


def test_repository_copy_is_current() -> None:
    assert (REPO / "docs" / "openapi.json").read_text() == render(), \
        "docs/openapi.json is stale: run `.venv/bin/python -m forkd.daemon.openapi > docs/openapi.json`"


def test_every_reference_in_the_document_resolves() -> None:
    """A response model named but not in the components (``CommandOutcome`` once) breaks every client
    generator and schema check; answers a test app never gives (an exec's 200) would not show it."""
    document = json.loads(render())
    refs: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.add(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    prefix = "#/components/schemas/"
    assert refs and all(ref.startswith(prefix) for ref in refs), refs
    assert sorted(r for r in refs if r[len(prefix):] not in document["components"]["schemas"]) == []


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("schemathesis")
    runtime = asyncio.run(Runtime.open(Paths(home=root / "home", cache=root / "cache", socket=root / "sock"),
                                       QemuVmm(accelerator="tcg")))
    return create_app(runtime)


def _operations(app):  # type: ignore[no-untyped-def]
    # Building an image runs debootstrap for minutes, and a pull would download from generated
    # URLs (the packs and node tests cover them): everything else is fuzzed.
    schema = schemathesis.openapi.from_asgi("/openapi.json", app).exclude(method="POST", path="/v1/images") \
        .exclude(method="POST", path="/v1/packs/pull").exclude(method="POST", path="/v1/node/pull")
    return [result.ok() for result in schema.get_all_operations()]


def test_no_server_errors_and_answers_match_the_schema(app) -> None:  # type: ignore[no-untyped-def]
    """Generated requests the schema admits are never refused as invalid (400, 413, 422: a pattern or bound
    missing from the document), and none gets a 5xx."""
    operations = _operations(app)
    assert len(operations) > 20
    failures = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case) -> None:  # type: ignore[no-untyped-def]
            response = case.call()
            assert response.status_code < 500, \
                f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:500]}"
            case.validate_response(response, checks=(status_code_conformance, content_type_conformance,
                                                     response_schema_conformance))
            assert_not_refused_at_the_boundary(case, response)

        try:
            fuzz()
        except (Exception, BaseExceptionGroup) as exc:  # collect all: one run shows every operation to fix
            failures.append(f"{operation.method.upper()} {operation.path}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)


def test_the_document_needs_no_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rendering the schema opens no state.db and makes no VMM: the app describes itself without a runtime."""
    def refused(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("rendering the OpenAPI document opened the runtime")

    monkeypatch.setattr("forkd.store.registry.Registry.__init__", refused)
    monkeypatch.setattr("forkd.runtime.runtime.Runtime.__init__", refused)
    monkeypatch.setattr("forkd.vmm.qemu.QemuVmm.__init__", refused)
    assert json.loads(render())["paths"]
    with pytest.raises(RuntimeError, match="without a runtime"), TestClient(create_app()):
        pass  # its lifespan refuses to serve
