"""Schemathesis over the E2B front's own OpenAPI document (the control plane it serves at
``/openapi.json``), against a whole daemon process on the fake VMM backend with its E2B listener.

Generated requests (valid and invalid) are often pointed at a live E2B sandbox and at a template
that exists, so create, connect, timeout, fork, pause, resume, snapshots, network and metrics run
for real behind the front. No answer may be a 5xx. Bounded: a fixed number of examples per
operation, derandomized, generation only (no shrinking against a sandbox that has changed since).
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from conftest import e2b_front, fake_daemon_on, vm_env_for
from free_ports import free_port
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(900)
EXAMPLES_PER_OPERATION = 25
TEMPLATE = "base"


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The front's URL and an API key's header, on a fake daemon holding the template ``base``."""
    home = Path(tmp_path_factory.mktemp("fe", numbered=True))
    listen = f"127.0.0.1:{free_port()}"
    with fake_daemon_on(home, f'[e2b]\nlisten = "{listen}"\n') as daemon:
        daemon.create_snapshot(TEMPLATE, memory_mib=256, warm_modules=[])
        url, key = e2b_front(home, {**vm_env_for(home), "FORKD_E2B_LISTEN": listen})
        yield url, {"X-API-KEY": key}


class Live:
    """A running and a paused E2B sandbox for generated requests to name, made again when a request
    ended one or changed its state."""

    def __init__(self, url: str, auth: dict[str, str]) -> None:
        self.url, self.auth = url, auth
        self._ids: dict[str, str] = {}

    def sandbox(self, state: str) -> str:
        known = self._ids.get(state)
        info = httpx.get(f"{self.url}/sandboxes/{known}", headers=self.auth, timeout=120) if known else None
        if info is None or info.status_code != 200 or info.json()["state"] != state:
            made = httpx.post(f"{self.url}/sandboxes", headers=self.auth, timeout=120,
                              json={"templateID": TEMPLATE, "timeout": 300})
            assert made.status_code == 201, made.text
            self._ids[state] = made.json()["sandboxID"]
            if state == "paused":
                paused = httpx.post(f"{self.url}/sandboxes/{self._ids[state]}/pause", headers=self.auth, timeout=120)
                assert paused.status_code == 204, paused.text
        return self._ids[state]


def _aim(case: Any, live: Live, state: str) -> None:
    """Point a generated case at a sandbox in ``state`` and at the template, keeping forks small."""
    params = case.path_parameters or {}
    if "sandboxID" in params:
        params["sandboxID"] = live.sandbox(state)
    if isinstance(case.body, dict):
        if "templateID" in case.body:
            case.body["templateID"] = TEMPLATE
        if isinstance(case.body.get("count"), int):
            case.body["count"] = max(1, min(case.body["count"], 2))


def test_the_front_serves_its_document_and_no_generated_request_gets_a_server_error(
        front: tuple[str, dict[str, str]]) -> None:
    url, auth = front
    document = httpx.get(f"{url}/openapi.json")  # no key needed: it describes, it controls nothing
    assert document.status_code == 200 and "/sandboxes" in document.json()["paths"]
    live = Live(url, auth)
    # Earlier tests' garbage goes now, not while pytest parses the modules schemathesis imports on first use:
    # on CPython 3.11 a finalizer that logs a traceback (its formatter parses source) inside that parse
    # breaks the AST constructor's shared depth counter ("AST constructor recursion depth mismatch").
    gc.collect()
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 17
    failures: list[str] = []
    for operation in operations:
        @given(case=operation.as_strategy(), aim=st.sampled_from([None, "running", "paused"]))
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  phases=[Phase.generate], report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
        def fuzz(case: Any, aim: str | None) -> None:
            if aim:
                _aim(case, live, aim)
            response = case.call(base_url=url, headers=auth, timeout=120)
            assert response.status_code < 500, \
                f"{case.method} {case.formatted_path} {case.query} {case.body!r:.300}: " \
                f"{response.status_code} {response.text[:500]}"

        try:
            fuzz()
        except Exception as exc:  # noqa: BLE001 - collect all, so one run shows every broken operation
            failures.append(f"{operation.method.upper()} {operation.path}: "
                            f"{''.join(traceback.format_exception(exc))[-2000:]}")
    assert not failures, "\n\n".join(failures)
