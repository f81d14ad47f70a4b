"""A guest program's ports and a sandbox's network through the E2B front, driven by E2B's unmodified
Python SDK against real guests: ``python3 -m http.server`` fetched through ``get_host(port)`` and the
header route, a WebSocket echo, 401 without the traffic token, 502 for a closed port, a public
sandbox; no network without an option, deny lists, ``allow_internet_access=False`` and
``update_network`` checked in the guest and in the child's namespace rules. The same through E2B's
unmodified JavaScript SDK (tests/e2b/js/ports_check.mjs: ``getHost(port)``, a WebSocket echo with the
``ws`` package, ``allowInternetAccess``, ``network.allowOut/denyOut``, ``updateNetwork``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import e2b_front

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm
E2B = Path(__file__).resolve().parent.parent / "e2b"


@pytest.fixture(scope="module")
def e2b_env(daemon: Controller, snapshot_tag: str, vm_env: dict[str, str], forkd_home: Path) -> dict[str, str]:
    url, key = e2b_front(forkd_home, vm_env)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "E2B_"))}
    env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key,
               E2B_TEST_TEMPLATE=snapshot_tag)
    return env


def _run(argv: list[str], env: dict[str, str], checks: set[str]) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1500)
    passed = set(re.findall(r"^ok (\S+)$", done.stdout, re.MULTILINE))
    assert done.returncode == 0 and passed == checks, \
        f"exit {done.returncode}; missing {sorted(checks - passed)}\n{done.stdout}\n{done.stderr[-8000:]}"


def test_guest_ports_through_the_python_sdk(e2b_env: dict[str, str]) -> None:
    _run([sys.executable, str(E2B / "python" / "ports_check.py")], e2b_env,
         {"http_server", "needs_token", "closed_port", "websocket", "public"})


def test_network_options_through_the_python_sdk(e2b_env: dict[str, str]) -> None:
    _run([sys.executable, str(E2B / "python" / "network_check.py")], e2b_env,
         {"no_option_no_link", "deny_list_then_update", "internet_off", "kept_across_pause"})


def test_guest_ports_and_network_through_the_javascript_sdk(e2b_env: dict[str, str]) -> None:
    _run(["node", str(E2B / "js" / "ports_check.mjs")], e2b_env,
         {"http_server", "needs_token", "closed_port", "websocket", "no_option_no_link", "deny_list_then_update",
          "internet_off"})
