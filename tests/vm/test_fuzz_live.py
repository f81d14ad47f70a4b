"""Fuzz the RUNNING daemon over TCP, with its token and live sandboxes, from the OpenAPI it serves.

Unlike tests/unit/test_openapi.py (an app without VMs), generated requests here reach real guests:
path parameters and bodies are often pointed at a live sandbox, the shared snapshot or a live
workspace, so exec, files, branch, workspace suspend and friends run for real. No answer may be a
5xx or differ from the documented schema. Bounded: a fixed number of examples per operation,
derandomized (a fixed seed), commands clamped to short timeouts. Image builds, snapshot creation
from an image (minutes of boot each) and pack transfers (downloads, host paths) are left out.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from forkd.sdk.controller import Controller, ForkdError
from openapi_checks import assert_not_refused_at_the_boundary

pytestmark = pytest.mark.vm

EXAMPLES_PER_OPERATION = 6
CALL_TIMEOUT_S = 30  # commands, cells and evals the fuzzer starts in live sandboxes (the host is loaded)
EXCLUDED = (("POST", "/v1/images"), ("DELETE", "/v1/images/{name}"), ("POST", "/v1/snapshots"))
WORKSPACE = "fuzzed"


class Live:
    """The live things generated requests are pointed at, re-made when a request ended them."""

    def __init__(self, controller: Controller, tag: str) -> None:
        self.controller = controller
        self.tag = tag
        self._sandbox: str | None = None

    def sandbox(self) -> str:
        running = {s["id"] for s in self.controller.sandboxes()}
        if self._sandbox not in running:
            result = self.controller.fork(self.tag, 1)
            assert result["errors"] == [], result["errors"]
            self._sandbox = result["sandboxes"][0]["id"]
        return self._sandbox

    def workspace(self) -> str:
        try:
            self.controller.request("GET", f"/v1/workspaces/{WORKSPACE}")
        except ForkdError:
            self.controller.request("POST", "/v1/workspaces", json={"name": WORKSPACE, "snapshot_tag": self.tag})
        return WORKSPACE


def _aim(case: Any, live: Live, aim: int) -> None:
    """Point a generated case at live things (``aim`` 0 leaves it as generated) and keep it short."""
    if aim:
        params = case.path_parameters or {}
        if "sandbox_id" in params:
            params["sandbox_id"] = live.sandbox()
        if "name" in params and "/v1/workspaces/" in case.path:
            params["name"] = live.workspace()
        if isinstance(case.body, dict):
            if "snapshot_tag" in case.body:
                case.body["snapshot_tag"] = live.tag
            if isinstance(case.body.get("n"), int):
                case.body["n"] = max(1, min(case.body["n"], 2))
            if case.path.endswith("/branch"):
                case.body["wait"] = True  # a background branch would make the next one a (documented) 503
    if aim and isinstance(case.body, dict) and case.path.endswith(("/exec", "/run_code", "/eval")):
        # Long enough that a slow guest is not a (documented) 504, short enough for the suite.
        case.body["timeout_s"] = CALL_TIMEOUT_S


@pytest.fixture
def tcp(vm_env: dict[str, str], daemon: Controller) -> tuple[str, dict[str, str]]:
    return f"http://{vm_env['FORKD_LISTEN']}", {"Authorization": f"Bearer {vm_env['FORKD_TOKEN']}"}


def test_the_live_daemon_answers_every_generated_request_within_its_schema(
        daemon: Controller, snapshot_tag: str, tcp: tuple[str, dict[str, str]]) -> None:
    url, auth = tcp
    before_sandboxes = {s["id"] for s in daemon.sandboxes()}
    before_snapshots = {s["tag"] for s in daemon.snapshots()}
    live = Live(daemon, snapshot_tag)
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=auth)
    for method, path in EXCLUDED:
        schema = schema.exclude(method=method, path=path)
    # Pulls and pushes would reach generated hosts; tests send traffic to loopback only. A drain would
    # refuse every later test's forks on this shared daemon and wait up to an hour for its live sandboxes.
    schema = schema.exclude(path_regex="^/v1/packs").exclude(method="POST", path="/v1/node/pull")
    schema = schema.exclude(path_regex="^/v1/node/drain")
    # A terminal's output stream ends only when its client leaves (as `docker exec -it` does): a generated
    # call would hold its read for the whole client timeout. tests/vm/test_cli_exec.py drives it.
    schema = schema.exclude(method="POST", path="/v1/sandboxes/{sandbox_id}/pty")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 30
    failures: list[str] = []
    try:
        for operation in operations:
            @given(case=operation.as_strategy(), aim=st.integers(0, 2))
            # Generate only: shrinking would replay requests against sandboxes that have changed since.
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                      phases=[Phase.generate], report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
            def fuzz(case: Any, aim: int) -> None:
                _aim(case, live, aim)
                response = case.call(base_url=url, headers=auth, timeout=300)
                where = f"{case.method} {case.formatted_path} {case.body!r:.300}"
                assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
                case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                                         response_schema_conformance], headers=auth)
                if not aim:  # aimed cases were changed after generation: no longer the schema's own
                    assert_not_refused_at_the_boundary(case, response)

            try:
                fuzz()
            except Exception as exc:  # collect all, so one run shows every broken operation
                failures.append(f"{operation.method.upper()} {operation.path}: "
                                f"{''.join(traceback.format_exception(exc))[-2500:]}")
    finally:
        with contextlib.suppress(ForkdError):
            daemon.request("DELETE", f"/v1/workspaces/{WORKSPACE}")
        for sandbox in daemon.sandboxes():
            if sandbox["id"] not in before_sandboxes:
                with contextlib.suppress(ForkdError):
                    daemon.kill(sandbox["id"])
        for snapshot in daemon.snapshots():
            if snapshot["tag"] not in before_snapshots:
                with contextlib.suppress(ForkdError):
                    daemon.request("DELETE", f"/v1/snapshots/{snapshot['tag']}", params={"cascade": "true"})
    assert not failures, "\n\n".join(failures)
