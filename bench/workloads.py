"""Real workloads, side by side in one run: where the warm state pays and where it does not.

1. pytest over examples/pytest_project (numpy, pandas, scipy, sklearn tests) three ways: serial in one
   child; one child per test file with a fresh ``python3 -m pytest``; one child per file with the same
   command forked from the guest's warm interpreter (``warm=True``). Wall time from the first fork to
   the last result; the three ways interleaved over ``--pytest-rounds`` rounds, medians compared.
2. The warm import saving: ``python3 -c 'import sklearn'`` in one live child, fresh vs warm, interleaved.
3. The fork-per-test PostgreSQL fixture: fork → the first query answered, per child.

    .venv/bin/python bench/workloads.py --repeats 5

Builds the ``workloads`` image and snapshot first if they are missing (as the VM tests do). Record the
load average: figures taken while other VM work runs are not comparable. Writes
bench/results/workloads.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from figures import plt, save  # bench/figures.py, next to this script

from forkd import Sandbox
from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller, ForkdError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import pytest_warm_fanout  # noqa: E402

RESULTS = Path(__file__).with_name("results")
TAG = "workloads"
PACKAGES = ["python3-pandas", "python3-sklearn", "python3-matplotlib", "postgresql"]
WARM = ["sklearn", *pytest_warm_fanout.project_imports()]  # as the pytest recipe says


def ensure_snapshot(api: Controller) -> None:
    """The workloads snapshot, made as the recipes say (PostgreSQL started and seeded by the postgres
    recipe's warmup command; the modules the pytest project imports warmed and pytest started once by
    that recipe's warm code); one made otherwise is made again."""
    try:
        made = api.snapshot(TAG)
    except ForkdError:
        made = None
    if made is not None:
        if made.get("warm_code") == pytest_warm_fanout.WARM_CODE and made.get("warm_modules") == WARM:
            return
        print(f"snapshot {TAG!r} was not made as the pytest recipe says: making it again", flush=True)
        api.remove_snapshot(TAG, cascade=True, force=True)
    warmup = subprocess.run([sys.executable, str(EXAMPLES / "postgres_fixture.py"), "--print-warmup"],
                            check=True, capture_output=True, text=True).stdout.strip()
    api.build_image(on_progress=print, name=TAG, packages=PACKAGES)
    api.create_snapshot(TAG, on_progress=print, image=TAG, warm_modules=WARM,
                        warm_code=pytest_warm_fanout.WARM_CODE, warmup_cmd=warmup)


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_s": round(statistics.median(ordered), 3), "p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
            "n": len(ordered)}


def timed_run(sandbox: Sandbox, command: str, warm: bool) -> float:
    started = time.perf_counter()
    sandbox.commands.run(command, timeout=300, warm=warm)
    return time.perf_counter() - started


def import_saving(repeats: int) -> dict[str, Any]:
    fresh, warm = [], []
    with Sandbox.create(template=TAG, timeout=1800) as sandbox:
        for _ in range(repeats):  # interleaved: noise lands on both
            fresh.append(timed_run(sandbox, "python3 -c 'import sklearn'", warm=False))
            warm.append(timed_run(sandbox, "python3 -c 'import sklearn'", warm=True))
    return {"fresh": summary(fresh), "warm": summary(warm),
            "ratio_p50": round(statistics.median(fresh) / statistics.median(warm), 2)}


def postgres_first_query(repeats: int) -> dict[str, Any]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        with Sandbox.create(template=TAG, timeout=300) as sandbox:
            sandbox.commands.run("psql -qAtX -c 'SELECT count(*) FROM accounts'", user="postgres", cwd="/tmp")
            samples.append(time.perf_counter() - started)
    return summary(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pytest-rounds", type=int, default=3,
                        help="rounds of the three pytest ways, interleaved (each round takes ~4 minutes here)")
    args = parser.parse_args()
    api = ensure_daemon()
    os.environ.setdefault("FORKD_URL", api.url)
    os.environ["FORKD_TEMPLATE"] = TAG
    ensure_snapshot(api)
    load_before = os.getloadavg()

    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in pytest_warm_fanout.MODES}
    for round_ in range(args.pytest_rounds):  # interleaved: noise lands on every way
        for mode in pytest_warm_fanout.MODES:
            wall, runs = pytest_warm_fanout.run_mode(mode)
            rounds[mode].append({"wall_s": round(wall, 2), "passed": sum(r.passed for r in runs),
                                 "failed": sum(r.failed for r in runs),
                                 "runs": [{"files": r.files, "exit_code": r.exit_code, "seconds": round(r.seconds, 2)}
                                          for r in runs]})
            print(f"round {round_} pytest {mode:6s}: {wall:6.1f} s, {rounds[mode][-1]['passed']} passed, "
                  f"{rounds[mode][-1]['failed']} failed", flush=True)
    fanout = {mode: {"wall_s": statistics.median(r["wall_s"] for r in done), "rounds": done}
              for mode, done in rounds.items()}
    imports = import_saving(args.repeats)
    print(f"import sklearn: fresh {imports['fresh']['p50_s']} s, warm {imports['warm']['p50_s']} s")
    postgres = postgres_first_query(args.repeats)
    print(f"postgres fork → first query: {postgres['p50_s']} s (p50)")

    report = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "pytest": fanout,
        "ratios": {"fresh_fanout_over_warm_fanout": round(fanout["fresh"]["wall_s"] / fanout["warm"]["wall_s"], 2),
                   "warm_fanout_over_serial": round(fanout["warm"]["wall_s"] / fanout["serial"]["wall_s"], 2)},
        "import_sklearn": imports, "postgres_fork_to_first_query": postgres,
    }
    print("ratios:", report["ratios"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "workloads.json").write_text(json.dumps(report, indent=2) + "\n")

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(fanout)
    left.bar(modes, [fanout[m]["wall_s"] for m in modes], color=["grey", "tab:orange", "tab:green"])
    left.set_ylabel("wall time, fork to last result (s)")
    left.set_title(f"pytest, {sum(1 for _ in EXAMPLES.glob('pytest_project/test_*.py'))} files")
    names = ["import sklearn\nfresh", "import sklearn\nwarm", "postgres fork\n→ first query"]
    right.bar(names, [imports["fresh"]["p50_s"], imports["warm"]["p50_s"], postgres["p50_s"]],
              color=["tab:orange", "tab:green", "tab:blue"])
    right.set_ylabel("median (s)")
    save(fig, RESULTS / "workloads.png", "forkd real workloads (TCG guest, 2 cores)", dpi=120)


if __name__ == "__main__":
    main()
