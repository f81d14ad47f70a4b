"""Spawn with the pool of ready VMMs off and on, side by side in one run, with every child's stage timings.

Per repeat, pool off then pool on (the same snapshot, daemon and load): a single fork until the
child answers a numpy eval (p50/p90 over ``--singles``), a fork of ``-n`` until all answer, memory
per live child with its breakdown (TCG translation cache, guest RAM copied on write, QEMU heap,
other), the eval round trip next to a ping's (the same path without the guest's work for the eval),
and each child's per-stage timings as the daemon reports them. With ``--scale N``, N children
requested at once (streamed) in each mode: how many answered and when the last did. The load
average is recorded before and after every phase; take figures on an idle machine only.

    .venv/bin/python bench/spawn.py --tag quickstart --repeats 3 -n 10 --singles 10 --pool-size 10 --scale 100

Writes bench/results/spawn.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from figures import load_span, plt, save  # bench/figures.py, next to this script

from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller

NUMPY_PROBE = "float(numpy.ones(4).sum())"
RESULTS = Path(__file__).with_name("results")
FILL_BOUND_S = 900.0


def load() -> float:
    return os.getloadavg()[0]


def quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    if not ordered:
        return {}
    return {"p50": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))], "n": len(ordered)}


def set_pool(controller: Controller, tag: str, size: int) -> None:
    """Resize and wait until the pool is full (or empty), so no refill runs during a measurement."""
    controller.set_pool_size(tag, size)
    deadline = time.monotonic() + FILL_BOUND_S
    while True:
        pool = next((p for p in controller.pools() if p["tag"] == tag), {"ready": 0, "starting": 0})
        if pool["ready"] == size and pool["starting"] == 0:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the pool of {tag} did not reach {size} in {FILL_BOUND_S:.0f} s: {pool}")
        time.sleep(0.2)


def smaps_breakdown(pid: int, memory_file: str) -> dict[str, float]:
    """Private_Dirty of one VMM in MiB by what holds it (read from /proc/<pid>/smaps; needs root)."""
    kinds = {"tcg_cache": 0, "guest_ram_cow": 0, "heap": 0, "other_anonymous": 0, "files": 0}
    kind = "files"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: range perms offset dev inode [path]
            path = fields[5] if len(fields) > 5 else ""
            if path == memory_file:
                kind = "guest_ram_cow"
            elif path == "[heap]":
                kind = "heap"
            elif not path and "x" in fields[1]:
                kind = "tcg_cache"  # the translation buffer is QEMU's only anonymous executable mapping
            elif not path or path.startswith("["):
                kind = "other_anonymous"
            else:
                kind = "files"
        elif fields[0] == "Private_Dirty:":
            kinds[kind] += int(fields[1])
    return {k: round(v / 1024, 2) for k, v in kinds.items()}


def fork_until_eval(controller: Controller, tag: str, n: int) -> dict[str, Any]:
    """Fork ``n``; time until every child answered a numpy eval; the children are left running."""
    started = time.monotonic()
    result = controller.fork(tag, n)
    ids = [child["id"] for child in result["sandboxes"]]
    with ThreadPoolExecutor(max_workers=max(1, min(32, n))) as pool:
        answers = list(pool.map(lambda sandbox_id: controller.eval(sandbox_id, NUMPY_PROBE), ids))
    assert all(answer["value_json"] == 4.0 for answer in answers), answers
    return {"all_ready_s": time.monotonic() - started, "ids": ids, "errors": result["errors"],
            "timings": [child["timings"] for child in result["sandboxes"]]}


def memory_of(controller: Controller, ids: list[str], memory_file: str) -> dict[str, Any]:
    children = [controller.sandbox(sandbox_id) for sandbox_id in ids]
    per_child = [smaps_breakdown(child["pid"], memory_file) for child in children]
    n = max(1, len(children))
    return {
        "pss_mib": sum(c["memory"]["pss_kib"] for c in children) / 1024 / n,
        "private_dirty_mib": sum(c["memory"]["private_dirty_kib"] for c in children) / 1024 / n,
        "private_dirty_breakdown_mib": {k: round(sum(b[k] for b in per_child) / n, 2) for k in per_child[0]}
        if per_child else {},
    }


def stage_medians(timings: list[dict[str, float]]) -> dict[str, float]:
    stages: dict[str, list[float]] = {}
    for child in timings:
        for stage, ms in child.items():
            stages.setdefault(stage, []).append(ms)
    return {stage: round(statistics.median(values), 2) for stage, values in stages.items()}


def one_mode(controller: Controller, tag: str, pool_size: int, args: argparse.Namespace,
             memory_file: str) -> dict[str, Any]:
    set_pool(controller, tag, pool_size)
    load_before = load()
    singles, single_timings = [], []
    for _ in range(args.singles):
        run = fork_until_eval(controller, tag, 1)
        singles.append(run["all_ready_s"])
        single_timings += run["timings"]
        controller.kill(run["ids"][0])
        set_pool(controller, tag, pool_size)  # refilled before the next one, as on a machine between requests
    batch = fork_until_eval(controller, tag, args.n)
    memory = memory_of(controller, batch["ids"], memory_file)
    # A ping goes the same REST and agent path but no further: eval minus ping is the guest's work
    # between the agent and the context's process. Interleaved, so both see the same load.
    round_trips: dict[str, list[float]] = {"eval": [], "ping": []}
    calls = {"eval": lambda: controller.eval(batch["ids"][0], "1"), "ping": lambda: controller.ping(batch["ids"][0])}
    for _ in range(args.round_trips):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            round_trips[name].append((time.perf_counter() - t0) * 1000)
    for sandbox_id in batch["ids"]:
        controller.kill(sandbox_id)
    return {
        "pool_size": pool_size, "load_before": load_before, "load_after": load(),
        "single_fork_to_eval_s": quantiles(singles), "single_stage_ms_p50": stage_medians(single_timings),
        f"fork_{args.n}_all_answer_eval_s": batch["all_ready_s"], "batch_errors": batch["errors"],
        "batch_stage_ms_p50": stage_medians(batch["timings"]),
        "memory_per_child": memory, "eval_round_trip_ms": quantiles(round_trips["eval"]),
        "ping_round_trip_ms": quantiles(round_trips["ping"]),
    }


def at_once(controller: Controller, tag: str, n: int, pool_size: int) -> dict[str, Any]:
    """``n`` children requested at once (streamed): how many answered, when the last did; then kill them."""
    set_pool(controller, tag, pool_size)
    load_before = load()
    started = time.monotonic()
    lines = list(controller.fork_iter(tag, n))
    last = time.monotonic() - started
    answered = [line["sandbox"]["id"] for line in lines if "sandbox" in line]
    errors = [line["error"] for line in lines if "sandbox" not in line]
    for sandbox_id in answered:
        controller.kill(sandbox_id)
    left = [s["id"] for s in controller.sandboxes() if s["id"] in answered]
    return {"n": n, "pool_size": pool_size, "answered": len(answered), "errors": errors[:5],
            "time_to_last_answer_s": last, "left_after_kill": len(left),
            "stage_ms_p50": stage_medians([line["timings"] for line in lines]),
            "load_before": load_before, "load_after": load()}


def plot(report: dict[str, Any], out: Path) -> None:
    modes = report["modes"]
    fig, (ax_time, ax_mem, ax_stage) = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = ["pool off", "pool on"]
    single = [statistics.median(r[m]["single_fork_to_eval_s"]["p50"] for r in modes) for m in ("off", "on")]
    batch_key = f"fork_{report['n']}_all_answer_eval_s"
    batch = [statistics.median(r[m][batch_key] for r in modes) for m in ("off", "on")]
    x = range(2)
    ax_time.bar([i - 0.2 for i in x], single, width=0.4, label="1 child → numpy eval (p50)")
    ax_time.bar([i + 0.2 for i in x], batch, width=0.4, label=f"{report['n']} children → all answer")
    ax_time.set_xticks(list(x), labels)
    ax_time.set_ylabel("seconds (median of repeats)")
    ax_time.legend(fontsize=8)
    breakdown = modes[-1]["off"]["memory_per_child"]["private_dirty_breakdown_mib"]
    ax_mem.bar(list(breakdown), list(breakdown.values()), color="tab:olive")
    ax_mem.set_ylabel("Private_Dirty MiB per child (last repeat, pool off)")
    ax_mem.tick_params(axis="x", labelrotation=25)
    stages = modes[-1]["on"]["single_stage_ms_p50"]
    stages_off = modes[-1]["off"]["single_stage_ms_p50"]
    names = [s for s in dict.fromkeys([*stages_off, *stages]) if s != "total"]
    ax_stage.barh([f"{s} (off)" for s in names], [stages_off.get(s, 0) for s in names], color="tab:gray")
    ax_stage.barh([f"{s} (on)" for s in names], [stages.get(s, 0) for s in names], color="tab:green")
    ax_stage.set_xlabel("ms per stage, single fork p50 (last repeat)")
    save(fig, out, f"forkd spawn, pool off vs on ({report['host']['accelerator']}, {load_span(report)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="quickstart")
    parser.add_argument("-n", type=int, default=10, help="children of the all-answer batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--singles", type=int, default=10, help="single forks per repeat and mode")
    parser.add_argument("--round-trips", type=int, default=100)
    parser.add_argument("--pool-size", type=int, default=10, help="pool size when on")
    parser.add_argument("--scale", type=int, default=0, help="also request this many at once, pool off and on")
    parser.add_argument("--out", default="spawn")
    args = parser.parse_args()

    controller = ensure_daemon()
    version = controller.version()
    memory_file = str(Path(controller.snapshot(args.tag)["path"]) / "memory")
    report: dict[str, Any] = {"snapshot": args.tag, "n": args.n, "repeats": args.repeats, "load_start": load(),
                              "host": {k: version[k] for k in ("accelerator", "vmm", "vmm_version")}, "modes": []}
    try:
        for repeat in range(args.repeats):  # interleaved so machine noise hits both alike
            off = one_mode(controller, args.tag, 0, args, memory_file)
            on = one_mode(controller, args.tag, args.pool_size, args, memory_file)
            report["modes"].append({"off": off, "on": on})
            print(f"repeat {repeat}: single p50 off {off['single_fork_to_eval_s']['p50']:.2f} s, "
                  f"on {on['single_fork_to_eval_s']['p50']:.2f} s", flush=True)
        if args.scale:
            report["at_once"] = [at_once(controller, args.tag, args.scale, size) for size in (0, args.pool_size)]
            for run in report["at_once"]:
                print(f"{args.scale} at once, pool {run['pool_size']}: {run['answered']} answered, last after "
                      f"{run['time_to_last_answer_s']:.1f} s", flush=True)
    finally:
        controller.set_pool_size(args.tag, 0)
    report["load_end"] = load()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / f"{args.out}.png")
    print(json.dumps({"load": [report["load_start"], report["load_end"]],
                      "last_repeat": report["modes"][-1], "at_once": report.get("at_once")}, indent=2))


if __name__ == "__main__":
    main()
