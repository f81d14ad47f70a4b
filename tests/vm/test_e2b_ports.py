"""A guest program's ports through the E2B front, driven by E2B's unmodified Python SDK against a
real guest: ``python3 -m http.server`` fetched through ``get_host(port)`` and the header route, a
WebSocket echo, 401 without the traffic token, 502 for a closed port, a public sandbox."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm
CHECKS = {"http_server", "needs_token", "closed_port", "websocket", "public"}
SCRIPT = Path(__file__).resolve().parent.parent / "e2b" / "python" / "ports_check.py"


def test_guest_ports_through_the_python_sdk(daemon: Controller, snapshot_tag: str, vm_env: dict[str, str],
                                            forkd_home: Path) -> None:
    keys = (forkd_home / "e2b" / "api-keys").read_text().split()
    url = f"http://{vm_env['FORKD_E2B_LISTEN']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "E2B_"))}
    env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=next(k for k in keys if k.startswith("e2b_")),
               E2B_TEST_TEMPLATE=snapshot_tag)
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1500)
    passed = set(re.findall(r"^ok (\S+)$", done.stdout, re.MULTILINE))
    assert done.returncode == 0 and passed == CHECKS, \
        f"exit {done.returncode}; missing {sorted(CHECKS - passed)}\n{done.stdout}\n{done.stderr[-8000:]}"
