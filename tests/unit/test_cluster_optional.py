"""Ray is an optional extra: everything but ``forkd.cluster`` imports without it, and the cluster
commands say how to get it."""

from __future__ import annotations

import subprocess
import sys

WITHOUT_RAY = "import sys; sys.modules['ray'] = None\n"  # `import ray` now raises ImportError


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_RAY + code], capture_output=True, text=True, timeout=120)


def test_the_core_and_the_cli_import_without_ray() -> None:
    done = run("import forkd, forkd.sdk.sandbox, forkd.cli.main, forkd.daemon.app, forkd.mcp.main\n"
               "assert 'forkd.cluster' not in sys.modules")
    assert done.returncode == 0, done.stderr


def test_cluster_commands_without_ray_say_how_to_get_it() -> None:
    done = run("from forkd.cli.main import cli\ncli(['cluster', 'status', '--ray-address', '127.0.0.1:1'])")
    assert done.returncode == 1
    assert "forkd.cluster needs Ray: install the extra with `pip install 'forkd[ray]'`" in done.stderr
    imported = run("import forkd.cluster")
    assert imported.returncode == 1 and "pip install 'forkd[ray]'" in imported.stderr
