"""``pip install forkd`` as a user gets it: the wheel built from this tree, installed into a clean venv with only
its light dependencies (resolved from the machine's configured index), used as a client against a real daemon
(fake VMM backend), type-checked from the installed copy (py.typed), and resolvable next to other versions of
httpx and pydantic. Server-only commands say which extra to install."""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import fake_daemon_on, short_tmp_dir

ROOT = Path(__file__).resolve().parents[2]
STEP_S = 300  # one build, venv or install step on a loaded machine; beyond it something hangs
#: Versions an agent app may already hold, older and newer than forkd's own test pins.
NEIGHBOURS = (("httpx==0.27.2", "pydantic==2.9.2"), ("httpx==0.28.1", "pydantic==2.14.4"))
SERVER_ONLY = ("fastapi", "uvicorn", "qemu", "pyroute2", "zstandard", "mcp", "prometheus_client")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without PYTHONPATH: the suite's sources (and their egg-info) must not stand in for the
    installed wheel."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **extra}


def run(*argv: str | Path, cwd: Path = Path("/"), env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                          timeout=STEP_S)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this tree, built from a copy (the build writes build/ and egg-info where it runs)."""
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", dist, tree)
    (built,) = dist.glob("forkd-*.whl")
    return built


def requirements(wheel: Path, extra: str | None = None) -> list[str]:
    """The wheel's own Requires-Dist: the light set, or one extra's additions."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(name))
    found = []
    for requirement in metadata.get_all("Requires-Dist") or []:
        spec, _, marker = requirement.partition(";")
        if (extra is None and not marker) or (extra is not None and f'extra == "{extra}"' in marker):
            found.append(spec.strip())
    return found


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A clean venv holding the wheel and its light dependencies only."""
    where = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", where)
    pip = (where / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    run(*pip, "--no-deps", wheel)
    run(*pip, *requirements(wheel))
    return where


def test_the_wheel_is_a_typed_light_client_with_the_server_side_in_extras(wheel: Path) -> None:
    light = requirements(wheel)
    assert sorted(r.split(">")[0].split("<")[0] for r in light) == ["click", "httpx", "pydantic", "rich"]
    assert all("==" not in r for r in light), light  # ranges: it installs next to an app's own versions
    daemon = " ".join(requirements(wheel, "daemon"))
    assert all(name in daemon for name in ("fastapi", "uvicorn", "qemu.qmp", "pyroute2", "zstandard")), daemon
    assert any(r.startswith("mcp") for r in requirements(wheel, "mcp"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "forkd/py.typed" in names and any(n.endswith("licenses/LICENSE") or n.endswith("/LICENSE")
                                             for n in names)


def test_the_installed_client_talks_to_a_daemon_and_refuses_server_commands_by_name(venv: Path) -> None:
    python = venv / "bin" / "python"
    for module in SERVER_ONLY:
        assert run(python, "-c", f"import {module}", check=False).returncode != 0, f"{module} came with the client"
    with short_tmp_dir("fkp-") as home, fake_daemon_on(home):
        env = clean_env(FORKD_URL=f"unix://{home}/forkd.sock")
        used = run(python, "-c", "import forkd; from forkd import Controller, Sandbox\n"
                   "api = Controller(); print(forkd.__version__, api.version()['vmm'], Sandbox.list())", env=env)
        assert used.stdout.split() == ["0.1.0", "fake", "[]"]
        listed = run(venv / "bin" / "forkd", "ps", "--json", env=env)
        assert listed.stdout.strip() == "[]"
    refused = run(venv / "bin" / "forkd", "daemon", check=False)
    assert refused.returncode == 1 and "pip install 'forkd[daemon]'" in refused.stderr


def test_a_users_script_type_checks_against_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    script = tmp_path / "user_script.py"
    shutil.copy(ROOT / "tests" / "typing" / "user_script.py", script)
    done = run(sys.executable, "-m", "mypy", "--strict", "--python-executable", venv / "bin" / "python",
               "--cache-dir", tmp_path / "cache", "--no-incremental", script, cwd=tmp_path,
               env=clean_env(MYPYPATH=""), check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert 'Revealed type is "str"' in done.stdout


@pytest.mark.parametrize("neighbours", NEIGHBOURS, ids=lambda pins: "+".join(pins))
def test_pip_install_forkd_resolves_next_to_other_httpx_and_pydantic(wheel: Path, tmp_path: Path,
                                                                     neighbours: tuple[str, str]) -> None:
    done = run(sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--disable-pip-version-check", "--report", tmp_path / "report.json", wheel, *neighbours, check=False)
    assert done.returncode == 0, done.stderr
    chosen = {item["metadata"]["name"]: item["metadata"]["version"]
              for item in json.loads((tmp_path / "report.json").read_text())["install"]}
    assert {pin.split("==")[0]: pin.split("==")[1] for pin in neighbours}.items() <= chosen.items()
    assert chosen["forkd"] == "0.1.0"
