"""``forkd template code-interpreter`` through the real CLI and daemon, then E2B's code-interpreter SDK
with no template named: the image is built once per cache (by its inputs, like every image), the
snapshot baked once per session."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller
from forkd.sdk.templates import CODE_INTERPRETER

pytestmark = pytest.mark.vm
SCRIPT = Path(__file__).resolve().parent.parent / "e2b" / "python" / "template_check.py"


def test_the_code_interpreter_template_serves_sandbox_create_without_a_template(
        daemon: Controller, vm_env: dict[str, str], forkd_home: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "forkd", "template", "code-interpreter", "--json"],
                           env=vm_env, capture_output=True, text=True, timeout=3600, check=False)
    assert built.returncode == 0, built.stderr[-4000:]
    assert daemon.snapshot(CODE_INTERPRETER.tag)["status"] == "ready"
    again = subprocess.run([sys.executable, "-m", "forkd", "template", "code-interpreter"], env=vm_env,
                           capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0 and CODE_INTERPRETER.tag in again.stdout, again.stderr[-4000:]  # reused

    keys = (forkd_home / "e2b" / "api-keys").read_text().split()
    url = f"http://{vm_env['FORKD_E2B_LISTEN']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "E2B_"))}
    env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=next(k for k in keys if k.startswith("e2b_")))
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1500,
                          check=False)
    passed = set(re.findall(r"^ok (\S+)$", done.stdout, re.MULTILINE))
    checks = {"warm_imports", "libraries", "chart"}
    assert done.returncode == 0 and passed == checks, \
        f"exit {done.returncode}; missing {sorted(checks - passed)}\n{done.stdout}\n{done.stderr[-8000:]}"
