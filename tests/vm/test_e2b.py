"""E2B's own SDKs drive forkd through its E2B front: the real ``e2b`` and ``e2b-code-interpreter``
packages (Python; JavaScript under tests/e2b/js), pointed at the daemon only through E2B's
environment variables, against real guests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm
HERE = Path(__file__).resolve().parent.parent / "e2b"
PYTHON_CHECKS = {"commands", "stdout_streams_before_the_end", "background_command_killed", "stdin", "non_zero_exit",
                 "files", "watch", "pty", "second_client", "set_timeout", "list", "wrong_api_key", "unknown_sandbox", "run_code",
                 "fork", "pause_resume", "kill"}
JS_CHECKS = PYTHON_CHECKS


@pytest.fixture(scope="module")
def e2b_env(daemon: Controller, snapshot_tag: str, vm_env: dict[str, str], forkd_home: Path) -> dict[str, str]:
    """E2B's variables, and nothing of forkd's, for a client process."""
    keys = (forkd_home / "e2b" / "api-keys").read_text().split()
    url = f"http://{vm_env['FORKD_E2B_LISTEN']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "E2B_"))}
    env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=next(k for k in keys if k.startswith("e2b_")),
               E2B_TEST_TEMPLATE=snapshot_tag)
    return env


def run_checks(argv: list[str], env: dict[str, str], expected: set[str]) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1500)
    passed = set(re.findall(r"^ok (\S+)$", done.stdout, re.MULTILINE))
    summary = "\n".join(re.findall(r"^(?:ok|FAIL) .*$", done.stdout, re.MULTILINE))
    assert done.returncode == 0 and passed == expected, \
        f"exit {done.returncode}; missing {sorted(expected - passed)}\n{summary}\n{done.stderr[-8000:]}"


def test_python_sdk(e2b_env: dict[str, str]) -> None:
    run_checks([sys.executable, str(HERE / "python" / "sdk_check.py")], e2b_env, PYTHON_CHECKS)


def test_javascript_sdk(e2b_env: dict[str, str]) -> None:
    """Node with the SDKs scripts/setup installed into tests/e2b/js (missing ones fail here, not skip)."""
    run_checks(["node", str(HERE / "js" / "sdk_check.mjs")], e2b_env, JS_CHECKS)
