"""BRANCH: pause window and caller-visible latency per mode and dirtied memory, with the per-stage
breakdown, waited for or not (``--modes live:nowait``); ten BRANCHes in a row; spawn time through diff chains of depth 0-3 vs a compacted (flat)
copy; layer bytes vs pages changed.

Each measurement uses a fresh child of ``--tag`` (a 1 GiB snapshot) that first fills a bytearray of
N MiB with random bytes in its warm interpreter. ``pause_ms`` is what the daemon measured from QMP
``stop`` to ``cont`` answered; ``latency_s`` is the caller's wall time for the whole BRANCH request;
``timings`` is the daemon's per-stage breakdown (ms). Spawn time is the daemon's seconds_to_answer.
Record the load average around a run (it is in the JSON): figures from a busy machine do not compare.

    FORKD_HOME=... .venv/bin/python bench/branch.py --tag vmtest --repeats 3

Writes bench/results/branch.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from figures import plt, save  # bench/figures.py, next to this script

from forkd.config import paths_from_env
from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller, ForkdError

RESULTS = Path(__file__).with_name("results")
PAGE = 4096


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, Any]:
    return {"values": values, "p50": statistics.median(values), "p90": percentile(values, 0.9)} if values else {}


def dirty_child(controller: Controller, tag: str, mib: int) -> str:
    sandbox_id = controller.fork(tag, 1)["sandboxes"][0]["id"]
    if mib:
        result = controller.run_code(sandbox_id, f"import os\nheld = bytearray(os.urandom({mib} << 20))\nlen(held)",
                                     timeout_s=300)
        assert result["error"] is None, result
    return sandbox_id


def one_branch(controller: Controller, tag: str, mode: str, mib: int, name: str) -> dict[str, Any]:
    """``mode`` may end in ``:nowait``: the caller's latency is then the answer with the snapshot still
    ``writing`` (right after the pause), and ``written_s`` when it was ready (polled every 20 ms)."""
    mode, _, nowait = mode.partition(":")
    sandbox_id = dirty_child(controller, tag, mib)
    written = None
    try:
        started = time.monotonic()
        info = controller.branch(sandbox_id, name, mode=mode, wait=not nowait)
        latency = time.monotonic() - started
        if nowait:
            assert info["status"] == "writing", info
            assert controller.exec(sandbox_id, "echo alive")["stdout"] == "alive\n"  # answers while it is written
            info = controller.wait_snapshot(name, timeout_s=300, poll_s=0.02)
            written = time.monotonic() - started
        assert controller.exec(sandbox_id, "echo alive")["stdout"] == "alive\n"
    finally:
        controller.kill(sandbox_id)
    own = "memory.layer" if info["memory_kind"] == "diff" else "memory"
    sizes = controller.snapshot(name)
    controller.remove_snapshot(name)
    return {"pause_ms": info["pause_ms"], "latency_s": latency, "written_s": written, "timings_ms": info["timings"],
            "private_pages": info["private_pages"], "changed_pages": info["changed_pages"],
            "precopied": info.get("precopied"), "memory_file_bytes": info["sizes"][own],
            "disk_layer_bytes": info["sizes"]["disk.qcow2"], "physical_bytes": sizes["own_bytes"]}


def stage_p50(timings: list[dict[str, float]]) -> dict[str, float]:
    """Median milliseconds of each stage over runs, in stage order."""
    return {stage: statistics.median(t[stage] for t in timings if stage in t) for stage in timings[0]} if timings else {}


def modes_grid(controller: Controller, tag: str, modes: list[str], dirty: list[int], repeats: int) -> dict[str, Any]:
    grid: dict[str, Any] = {}
    for mode in modes:
        for mib in dirty:
            runs: list[dict[str, Any]] = []
            for r in range(repeats):
                try:
                    runs.append(one_branch(controller, tag, mode, mib, f"bench-{mode.replace(':', '-')}-{mib}-{r}"))
                except ForkdError as exc:
                    grid[f"{mode}/{mib}"] = {"refused": exc.message}
                    break
                print(mode, mib, runs[-1], flush=True)
            if runs:
                grid[f"{mode}/{mib}"] = {
                    "runs": runs,
                    "pause_ms": summary([run["pause_ms"] for run in runs]),
                    "latency_s": summary([run["latency_s"] for run in runs]),
                    "stages_ms_p50": stage_p50([run["timings_ms"] for run in runs]),
                }
            if mode == "live" and "refused" in grid.get(f"{mode}/{mib}", {}):
                break  # the host cannot do it; one refusal says so
    return grid


def series(controller: Controller, tag: str, count: int) -> dict[str, Any]:
    sandbox_id = dirty_child(controller, tag, 0)
    tags = [f"bench-series-{i}" for i in range(count)]
    pauses, latencies, timings = [], [], []
    try:
        for i, name in enumerate(tags):
            controller.exec(sandbox_id, f"head -c 4M /dev/urandom > /tmp/step-{i}")
            started = time.monotonic()
            info = controller.branch(sandbox_id, name)
            latencies.append(time.monotonic() - started)
            pauses.append(info["pause_ms"])
            timings.append(info["timings"])
    finally:
        controller.kill(sandbox_id)
        controller.remove_snapshot(tags[0], cascade=True)
    return {"pause_ms": pauses, "latency_s": latencies, "timings_ms": timings, "stages_ms_p50": stage_p50(timings)}


def chain_spawns(controller: Controller, tag: str, depth: int, layer_mib: int, repeats: int) -> dict[str, Any]:
    """Spawn time of a child at each depth of a diff chain, and of a compacted copy of the deepest."""
    tags = [tag]
    for level in range(1, depth + 1):
        name = f"bench-chain-{level}"
        controller.snapshot_diff(tags[-1], name, f"head -c {layer_mib}M /dev/urandom > /tmp/layer-{level}")
        tags.append(name)
    controller.compact(tags[-1], "bench-chain-flat")
    results: dict[str, Any] = {}
    try:
        for label, name in [*((f"depth {i}", t) for i, t in enumerate(tags)), ("flat", "bench-chain-flat")]:
            spawn = []
            for _ in range(repeats):
                child = controller.fork(name, 1)["sandboxes"][0]
                spawn.append(child["seconds_to_answer"])
                controller.kill(child["id"])
            results[label] = summary(spawn)
            print(label, results[label], flush=True)
    finally:
        controller.remove_snapshot("bench-chain-flat")
        if depth:
            controller.remove_snapshot(tags[1], cascade=True)
    base = results["depth 0"]["p50"]
    results["per_layer_tax_pct"] = [100 * (results[f"depth {i}"]["p50"] - base) / base / i for i in range(1, depth + 1)]
    return results


def plot(data: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    grid = data["modes"]
    for mode in ("full", "diff", "live", "live:nowait"):
        keys = [k for k in grid if k.startswith(mode + "/") and "pause_ms" in grid[k]]
        if keys:
            axes[0].plot([int(k.split("/")[1]) for k in keys], [grid[k]["pause_ms"]["p50"] for k in keys], "o-",
                         label=f"{mode} pause (p50)")
            axes[0].plot([int(k.split("/")[1]) for k in keys], [grid[k]["latency_s"]["p50"] * 1000 for k in keys],
                         "x--", label=f"{mode} caller latency (p50)")
    axes[0].set(xlabel="MiB dirtied in the guest", ylabel="ms", title="BRANCH of a 1 GiB guest")
    axes[0].legend(fontsize=7)
    axes[1].bar(range(1, len(data["series"]["pause_ms"]) + 1), data["series"]["pause_ms"])
    axes[1].set(xlabel="consecutive BRANCH of one sandbox", ylabel="pause (ms)", title="ten BRANCHes in a row")
    chain = {k: v for k, v in data["chain"].items() if isinstance(v, dict)}
    axes[2].bar(list(chain), [v["p50"] for v in chain.values()])
    axes[2].set(ylabel="seconds to first answer (p50)", title="spawn through a diff chain")
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="quickstart", help="a ready snapshot with 1 GiB of RAM")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dirty", default="0,16,64,256", help="MiB to dirty before each BRANCH (16 is the size the targets in docs/benchmarks.md name)")
    parser.add_argument("--modes", default="full,diff,live,live:nowait",
                        help="a mode ending in :nowait is BRANCHed with wait=false (answered after the pause)")
    parser.add_argument("--only-modes", action="store_true", help="skip the series and chain runs")
    parser.add_argument("--out", default="branch", help="results file name (without extension)")
    parser.add_argument("--series", type=int, default=10)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--layer-mib", type=int, default=16)
    args = parser.parse_args()
    controller = ensure_daemon(paths_from_env())
    started = time.monotonic()
    data = {"tag": args.tag, "repeats": args.repeats, "host": controller.version(),
            "load_average_before": os.getloadavg()}
    data["home"] = str(paths_from_env().home)
    data["modes"] = modes_grid(controller, args.tag, args.modes.split(","), [int(x) for x in args.dirty.split(",")],
                               args.repeats)
    if not args.only_modes:
        data["series"] = series(controller, args.tag, args.series)
        data["chain"] = chain_spawns(controller, args.tag, args.depth, args.layer_mib, max(3, args.repeats))
    data["runtime_s"] = time.monotonic() - started
    data["load_average_after"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=2))
    if not args.only_modes:
        plot(data, RESULTS / f"{args.out}.png")
    print(json.dumps({k: v for k, v in data.items() if k != "modes"}, indent=2))


if __name__ == "__main__":
    main()
