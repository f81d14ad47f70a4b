"""The SDK as its users' type checkers see it: ``mypy --strict`` over the SDK and over user scripts (tests/typing/),
the public names a type checker reads equal the ones ``forkd`` hands out at run time, and keyword arguments
a type checker would refuse are refused at run time too."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import forkd
from forkd.sdk.errors import InvalidArgumentException
from forkd.sdk.sandbox.options import network
from forkd.sdk.sandbox_async import AsyncSandbox
from forkd.sdk.sandbox_sync import Sandbox

ROOT = Path(__file__).resolve().parents[2]
TYPING = ROOT / "tests" / "typing"


def mypy(tmp_path: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` on ``targets`` with this tree's sources (pyproject.toml's [tool.mypy]), a fresh cache."""
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(tmp_path / "cache"), *targets],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_mypy_strict_passes_over_the_sdk_and_a_users_script_sees_real_types(tmp_path: Path) -> None:
    done = mypy(tmp_path, "src/forkd/sdk", "src/forkd/integrations", str(TYPING / "user_script.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert 'user_script.py:31: note: Revealed type is "str"' in done.stdout  # sbx.commands.run(...).stdout


def test_mypy_reports_a_users_mistakes(tmp_path: Path) -> None:
    done = mypy(tmp_path, str(TYPING / "refused" / "mistakes.py"))
    errors = re.findall(r"mistakes\.py:(\d+): error: (.*)", done.stdout)
    assert done.returncode == 1
    assert [int(line) for line, _ in errors] == [7, 9, 10, 11], done.stdout
    assert 'Unexpected keyword argument "templat"' in errors[0][1]
    assert '"CommandHandle" has no attribute "stdout"' in errors[1][1]


def test_the_names_type_checkers_read_are_the_ones_forkd_hands_out() -> None:
    tree = ast.parse((ROOT / "src" / "forkd" / "__init__.py").read_text())
    checked = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.If)
               for inner in node.body if isinstance(inner, ast.ImportFrom) for alias in inner.names}
    assert checked == set(forkd._EXPORTS) == set(forkd.__all__) - {"__version__"}
    for name in forkd._EXPORTS:
        assert getattr(forkd, name).__name__ in (name, "ForkdError")  # SandboxException is ForkdError's alias
    assert forkd.__version__ != "0+unknown"  # read from the installed metadata: pyproject.toml's version


@pytest.mark.parametrize("call", [
    lambda: Sandbox.create(templat="py"),
    lambda: Sandbox.create("py", allow_internet=True),
    lambda: Sandbox.connect("sb-000000000000", tokn="x"),
    lambda: Sandbox.list(urll="unix:///nowhere"),
    lambda: AsyncSandbox.create(templat="py"),
])
def test_an_unknown_keyword_argument_raises_type_error_before_any_request(call: object) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        call()  # type: ignore[operator]


def test_allow_internet_access_is_e2bs_spelling_of_net() -> None:
    assert network(None, None) is None  # the daemon's default: no network
    assert network(None, True) == "nat" and network(None, False) == "none"
    assert network("nat", True) == "nat" and network("nat", None) == "nat"
    with pytest.raises(InvalidArgumentException, match="contradicts"):
        network("none", True)


def test_every_public_method_says_what_it_does() -> None:
    from forkd.sdk.async_controller import AsyncController
    from forkd.sdk.connection import ConnectionConfig
    from forkd.sdk.controller import Controller
    from forkd.sdk.sandbox_async import AsyncCommandHandle, AsyncCommands, AsyncFilesystem
    from forkd.sdk.sandbox_sync import CommandHandle, Commands, Filesystem

    undocumented = []
    for cls in (Sandbox, Commands, Filesystem, CommandHandle, AsyncSandbox, AsyncCommands, AsyncFilesystem,
                AsyncCommandHandle, Controller, AsyncController, ConnectionConfig):
        for name in dir(cls):
            attribute = inspect.getattr_static(cls, name)
            if name.startswith("_") or not (callable(getattr(cls, name)) or isinstance(attribute, property)):
                continue
            function = attribute.__func__ if isinstance(attribute, classmethod | staticmethod) else attribute
            if not function.__doc__ or function.__doc__ == type(function).__doc__:
                undocumented.append(f"{cls.__name__}.{name}")
    assert undocumented == []
