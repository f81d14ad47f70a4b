"""Parallel pytest fan-out: one project, N test shards, each in its own child VM forked in parallel.

SWE-bench-style harnesses run a candidate patch's tests in isolation; forking from a warm snapshot
makes each isolated run cost a fork, not a boot. Every child gets the same project files, runs its
shard with pytest, and reports; a shard that fails does not stop the others.

    forkd quickstart && .venv/bin/python examples/pytest_fanout.py --shards 3
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

from forkd import CommandExitException, Sandbox

PROJECT = {
    "/work/calc.py": "def add(a, b):\n    return a + b\n\n\ndef div(a, b):\n    return a / b\n",
    "/work/test_add.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    "/work/test_div.py": "import pytest\nfrom calc import div\n\n\ndef test_div():\n    assert div(6, 3) == 2\n\n\n"
                         "def test_div_zero():\n    with pytest.raises(ZeroDivisionError):\n        div(1, 0)\n",
    "/work/test_broken.py": "from calc import add\n\n\ndef test_wrong_on_purpose():\n    assert add(2, 2) == 5\n",
}


def run_shard(index: int, shards: int) -> tuple[int, int, str]:
    """Fork a child, copy the project in, run every ``shards``-th test file; (index, exit code, summary)."""
    tests = sorted(path for path in PROJECT if path.rsplit("/", 1)[1].startswith("test_"))[index::shards]
    with Sandbox.create(timeout=600) as sandbox:
        sandbox.files.write_files([{"path": path, "data": text} for path, text in PROJECT.items()])
        try:
            result = sandbox.commands.run(f"cd /work && python3 -m pytest -q {' '.join(tests)}", timeout=300)
            code, output = 0, result.stdout
        except CommandExitException as failed:
            code, output = failed.exit_code, failed.stdout
    summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
    return index, code, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=3)
    shards = parser.parse_args().shards
    with ThreadPoolExecutor(shards) as pool:
        outcomes = sorted(pool.map(lambda i: run_shard(i, shards), range(shards)))
    for index, code, summary in outcomes:
        print(f"shard {index}: exit {code}: {summary}")
    failed = [index for index, code, _ in outcomes if code != 0]
    print("failed shards:", failed or "none")


if __name__ == "__main__":
    main()
