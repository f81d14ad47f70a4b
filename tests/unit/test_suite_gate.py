"""The test suite refuses to pass by skipping: selected VM tests on a host that cannot run them fail the run.

The suite is run as an unprivileged user (``setpriv`` from root, or as is when not root), which is
exactly the situation where every VM test used to skip and the run still exited 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def _pytest_unprivileged(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FORKD_TESTS"}
    env.update({"PYTHONDONTWRITEBYTECODE": "1", **(env_extra or {})})
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv is not None, "setpriv (util-linux) is needed to run the suite as an unprivileged user"
        command = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_vm_tests_without_root_fail_the_run_saying_what_to_do() -> None:
    done = _pytest_unprivileged("tests/vm/test_limits.py")
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, output
    assert "VM tests are selected but this host lacks: root" in output
    assert "FORKD_TESTS=unit" in output


def test_opting_out_runs_no_vm_test_and_says_so() -> None:
    done = _pytest_unprivileged("tests/vm/test_limits.py", "tests/unit/test_validation.py",
                                env_extra={"FORKD_TESTS": "unit"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "VM tests run: 0 (FORKD_TESTS=unit)" in output
    assert "deselected" in output


def test_every_test_file_name_is_unique_across_the_suite() -> None:
    """Test directories are not packages, so pytest imports each file by its base name: a second file of the
    same name in another directory stops the whole run at collection (which a unit-only run never sees)."""
    names = sorted(path.name for path in (REPO / "tests").rglob("test_*.py") if "node_modules" not in path.parts)
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


ROOT_ONLY = ("tests/unit/test_netns.py", "tests/unit/test_nftrules.py::test_nft_accepts_the_rulesets",
             "tests/unit/test_agent.py::test_exec_as_user", "tests/unit/test_agent.py::test_reseed_with_privileges")


def test_root_only_unit_tests_fail_without_root_and_name_what_to_install(tmp_path: Path) -> None:
    """Netns, nft rules and the agent's privilege drop are unit tests that need root and host tools: as
    an unprivileged user with none of the tools on PATH each fails saying what is missing, none skips."""
    done = _pytest_unprivileged(*ROOT_ONLY, env_extra={"FORKD_TESTS": "unit", "PATH": str(tmp_path)})
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "6 errors" in output and "skipped" not in output and "passed" not in output, output  # failed in setup
    # Once per test in the ERRORS section (with CI set, pytest repeats each message in its summary too).
    assert output.count("ERROR at setup of") == 6 and "this test needs root (run the suite as root" in output, output
    for needed in ("`nft` (install nftables)", "`ip` (install iproute2)", "`setpriv` (install util-linux)",
                   "`unshare` (install util-linux)", "-m 'not root'"):
        assert needed in output, needed
