"""Parallel pytest over a numpy/pandas/scikit-learn project: one child VM per test file, three ways.

An evaluation harness runs a project's tests in isolation, many at once. Forking from a snapshot
whose interpreter already imported numpy, pandas and sklearn makes each isolated run cost a fork.
But a fresh ``python3 -m pytest`` in the child imports everything again; with ``warm=True`` the
command is forked from the guest's warm interpreter instead, so the imports are already done.

    serial  one child runs every file (the baseline)
    fresh   one child per file, ``python3 -m pytest FILE`` started as a new process
    warm    one child per file, the same command forked from the warm interpreter

Warm what the tests import, not only the packages' names: ``import sklearn`` imports none of its
estimators, and ``from sklearn.cluster import KMeans`` in a test file then costs seconds in every
child. :func:`project_imports` lists the modules the project's files import (its own excepted).
Importing pytest is not all of its start-up either: every run also imports its built-in plugins,
registers their hooks, builds its option parser and scans the installed packages' entry points
(~3 s of a warm run under TCG). The snapshot's warm code (:data:`WARM_CODE`) runs pytest once
over an empty directory in the warm interpreter, so every warm run forks with that done.

Make the snapshot once, then run:

    forkd image build --name sci --package python3-pandas --package python3-sklearn
    forkd snapshot create --tag sci --image sci $(.venv/bin/python examples/pytest_warm_fanout.py --print-warm-flags) \
        --warm-code "$(.venv/bin/python examples/pytest_warm_fanout.py --print-warm-code)"
    FORKD_TEMPLATE=sci .venv/bin/python examples/pytest_warm_fanout.py --mode warm
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from forkd import CommandExitException, Sandbox

PROJECT = Path(__file__).resolve().parent / "pytest_project"
WORKDIR = "/work"
MODES = ("serial", "fresh", "warm")
_SUMMARY = re.compile(r"(\d+) (passed|failed|error|errors)")
#: The snapshot's warm code: one pytest run over an empty directory, its output thrown away.
WARM_CODE = """\
def _start_pytest_once():
    import contextlib, io, tempfile, pytest
    with tempfile.TemporaryDirectory() as empty, contextlib.redirect_stdout(io.StringIO()):
        pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", empty])
_start_pytest_once()
del _start_pytest_once
"""


@dataclass
class Run:
    """One pytest run in one child: which files, its exit code and pytest's counts."""

    files: list[str]
    exit_code: int
    passed: int
    failed: int
    seconds: float
    summary: str


def project_imports() -> list[str]:
    """The modules the project's files import, in first-seen order, without the project's own, and pytest."""
    own = {path.stem for path in PROJECT.glob("*.py")}
    found: dict[str, None] = {}
    for path in sorted(PROJECT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found.update((name, None) for name in names if name.partition(".")[0] not in own | {"__future__"})
    found.setdefault("pytest", None)  # what runs them
    return list(found)


def test_files() -> list[str]:
    return sorted(p.name for p in PROJECT.glob("test_*.py"))


def upload_project(sandbox: Sandbox) -> None:
    sandbox.files.write_files([{"path": f"{WORKDIR}/{p.name}", "data": p.read_bytes()}
                               for p in sorted(PROJECT.iterdir()) if p.suffix == ".py"])


def run_pytest(files: list[str], warm: bool) -> Run:
    """Fork a child, upload the project, run pytest on ``files`` (time counted from the fork)."""
    started = time.monotonic()
    with Sandbox.create(timeout=900) as sandbox:
        upload_project(sandbox)
        command = f"python3 -m pytest -q -p no:cacheprovider {' '.join(files)}"
        try:
            result = sandbox.commands.run(command, cwd=WORKDIR, timeout=600, warm=warm)
            code, output = 0, result.stdout
        except CommandExitException as failed:
            code, output = failed.exit_code, failed.stdout + failed.stderr
    counts = {kind: int(n) for n, kind in _SUMMARY.findall(output)}
    lines = output.strip().splitlines()
    return Run(files, code, counts.get("passed", 0), counts.get("failed", 0), time.monotonic() - started,
               lines[-1] if lines else "(no output)")


def run_mode(mode: str) -> tuple[float, list[Run]]:
    """Wall time and runs of one way of running the whole project."""
    started = time.monotonic()
    if mode == "serial":
        runs = [run_pytest(test_files(), warm=False)]
    else:
        files = test_files()
        with ThreadPoolExecutor(len(files)) as pool:
            runs = list(pool.map(lambda f: run_pytest([f], warm=mode == "warm"), files))
    return time.monotonic() - started, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, action="append", help="repeatable; default: all three")
    parser.add_argument("--json", action="store_true", help="print one JSON object per mode")
    parser.add_argument("--print-warm-flags", action="store_true",
                        help="print the snapshot's --warm flags (the modules the project imports)")
    parser.add_argument("--print-warm-code", action="store_true", help="print the snapshot's warm code")
    args = parser.parse_args()
    if args.print_warm_flags:
        print(" ".join(f"--warm {name}" for name in project_imports()))
        return
    if args.print_warm_code:
        print(WARM_CODE, end="")
        return
    for mode in args.mode or MODES:
        wall, runs = run_mode(mode)
        if args.json:
            print(json.dumps({"mode": mode, "wall_s": wall, "runs": [asdict(r) for r in runs]}))
            continue
        passed, failed = sum(r.passed for r in runs), sum(r.failed for r in runs)
        print(f"{mode}: {passed} passed, {failed} failed in {wall:.1f} s")
        for run in runs:
            print(f"  {' '.join(run.files)}: exit {run.exit_code}: {run.summary}")


if __name__ == "__main__":
    main()
