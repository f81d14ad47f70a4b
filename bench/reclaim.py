"""Idle reclaim: what paging out idle-stopped children's memory to swap saves, and what their next
request pays for it; memory kept and memory paged out side by side in one run.

The bench runs its own daemon on its own home (the image cache is shared), bakes ``--tag`` there if
it is missing (the quickstart's settings: 1 GiB, numpy warm). With ``--zram-gib N`` it makes a zram
swap of N GiB for the run (a device of its own, at a priority above any other swap) and removes it
after, and the report says so; without, it uses the host's swap (and says there is none). Then, for
each arm, a daemon with ``idle_stop_s = --idle-stop`` and ``idle_reclaim`` off ("kept") or on
("reclaimed"):

1. forks ``--n`` children, evals once in each (so each has run guest code), and reads each VMM's
   ``/proc/PID/smaps_rollup`` (Private_Dirty, Swap) while it runs;
2. waits until every child is idle-stopped (and, reclaimed, paged out), reads it again, and the
   zram device's ``mm_stat`` (bytes stored, compressed, and the memory the device uses) per child;
3. evals once more in each: the first request after the stop (``cont``, the clock set, the eval, and
   reclaimed, the page faults that bring its memory back), then a second eval (warm again), and
   reads the memory once more.

The load average is recorded before and after each arm: take figures on an idle machine only.

    .venv/bin/python bench/reclaim.py --n 20 --zram-gib 4

Writes bench/results/reclaim.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from density import BenchDaemon, baked, bench_home, fork_all, write_report  # bench/density.py, next to this script
from figures import load_span, plt, save
from spawn import load, quantiles

from forkd.sdk.controller import Controller
from forkd.vmm.pageout import swap_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zram_swap  # noqa: E402  tests/zram_swap.py: the same set-up the VM test uses

WAIT_S = 600.0  # bound on every child being stopped (and paged out)


def rollup(pid: int) -> dict[str, float]:
    """Private_Dirty and Swap of a VMM, MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split()[:2]
        fields[name.rstrip(":")] = int(value)
    return {"private_dirty_mib": fields.get("Private_Dirty", 0) / 1024, "swap_mib": fields.get("Swap", 0) / 1024}


def memory(pids: list[int]) -> dict[str, Any]:
    per_child = []
    for pid in pids:
        with contextlib.suppress(OSError):
            per_child.append(rollup(pid))
    n = max(1, len(per_child))
    return {"children": len(per_child),
            **{f"{key}_mean": round(sum(c[key] for c in per_child) / n, 2) for key in ("private_dirty_mib", "swap_mib")},
            "private_dirty_mib": quantiles([c["private_dirty_mib"] for c in per_child])}


def timed_evals(controller: Controller, ids: list[str]) -> dict[str, Any]:
    times, failed = [], 0
    for sandbox_id in ids:
        t0 = time.perf_counter()
        try:
            assert controller.eval(sandbox_id, "1 + 1")["value"] == "2"
        except Exception:
            failed += 1
            continue
        times.append((time.perf_counter() - t0) * 1000)
    return {**quantiles(times), "failed": failed}


def all_stopped(controller: Controller, ids: list[str], reclaimed: bool) -> float:
    """Seconds until every child is idle-stopped (and paged out when ``reclaimed``), bounded."""
    t0 = time.monotonic()
    while True:
        listed = {s["id"]: s for s in controller.sandboxes()}
        done = [i for i in ids if listed.get(i, {}).get("vm_state") == "idle_stopped"
                and (not reclaimed or "reclaimed_kib" in listed[i])]
        if len(done) == len(ids) or time.monotonic() - t0 > WAIT_S:
            return time.monotonic() - t0
        time.sleep(0.5)


def arm(daemon: BenchDaemon, args: argparse.Namespace, reclaimed: bool, device: str | None) -> dict[str, Any]:
    load_before = load()
    controller = daemon.start(idle_stop_s=args.idle_stop, keep_on_stop=False, idle_reclaim=reclaimed)
    try:
        assert daemon.process is not None
        forked = fork_all(controller, daemon.process.pid, args.tag, args.n, args.n)
        ids = forked.pop("ids")
        warm = timed_evals(controller, ids)
        pids = [int(s["pid"]) for s in controller.sandboxes() if s["id"] in ids]
        running = memory(pids)
        zram_before = zram_swap.mm_stat(device) if device else None
        stopped_after = all_stopped(controller, ids, reclaimed)
        stopped = memory(pids)
        zram = None
        if device and zram_before:
            after = zram_swap.mm_stat(device)
            zram = {key: round((after[key] - zram_before[key]) / max(1, len(ids)) / 2**20, 2) for key in after}
        time.sleep(args.idle_stop)
        first = timed_evals(controller, ids)  # each the first request after its stop
        second = timed_evals(controller, ids)
        woken = memory(pids)
        return {"fork": forked, "eval_running_ms": warm, "memory_running": running, "all_stopped_after_s": stopped_after,
                "memory_stopped": stopped, "zram_per_child_mib": zram, "eval_first_after_stop_ms": first,
                "eval_second_ms": second, "memory_after_wake": woken, "load_before": load_before, "load_after": load()}
    finally:
        controller.close()
        daemon.stop()


def plot(report: dict[str, Any], out: Path) -> None:
    kept, paged = report["kept"], report["reclaimed"]
    fig, (ax_mem, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    phases = ["running", "stopped", "after wake"]
    for offset, (name, result) in enumerate((("kept", kept), ("paged out", paged))):
        values = [result[key]["private_dirty_mib_mean"] for key in ("memory_running", "memory_stopped",
                                                                    "memory_after_wake")]
        ax_mem.bar([i + 0.4 * offset for i in range(3)], values, width=0.4, label=name)
    ax_mem.set_xticks([i + 0.2 for i in range(3)], phases)
    ax_mem.set_ylabel(f"Private_Dirty MiB per child, mean of {report['n']}")
    ax_mem.legend(fontsize=8)
    for offset, (name, result) in enumerate((("kept", kept), ("paged out", paged))):
        values = [result[key].get("p50", 0) for key in ("eval_running_ms", "eval_first_after_stop_ms",
                                                        "eval_second_ms")]
        ax_eval.bar([i + 0.4 * offset for i in range(3)], values, width=0.4, label=name)
    ax_eval.set_xticks([i + 0.2 for i in range(3)], ["running", "first after stop", "second"])
    ax_eval.set_ylabel("eval round trip p50, ms")
    ax_eval.legend(fontsize=8)
    save(fig, out, f"forkd idle reclaim, {report['n']} children per arm ({load_span(report)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20, help="children per arm")
    parser.add_argument("--tag", default="density", help="snapshot forked (baked in the bench home if missing)")
    parser.add_argument("--idle-stop", type=float, default=2.0, help="idle_stop_s of the daemons")
    parser.add_argument("--zram-gib", type=float, help="make a zram swap of this size for the run, removed after")
    parser.add_argument("--home", type=Path, help="the bench daemon's FORKD_HOME (default: a new one, removed)")
    parser.add_argument("--out", default="reclaim")
    args = parser.parse_args()

    home = bench_home(args, "reclaim")
    daemon = BenchDaemon(home, args.n)
    report: dict[str, Any] = {"n": args.n, "idle_stop_s": args.idle_stop, "cpus": os.cpu_count(), "load_start": load()}
    with contextlib.ExitStack() as stack:
        device = None
        if args.zram_gib:
            if reason := zram_swap.unavailable():
                raise SystemExit(f"--zram-gib: {reason}")
            device = stack.enter_context(zram_swap.zram_swap(int(args.zram_gib * 2**30)))
        report["swap"] = {"made_for_the_run": device, "zram_gib": args.zram_gib, "host_swap_bytes": swap_bytes()}
        if not report["swap"]["host_swap_bytes"]:
            print("this host has no swap: the reclaimed arm pages nothing out (use --zram-gib N)", flush=True)
        try:
            controller = daemon.start(idle_stop_s=0, keep_on_stop=False)
            report["host"] = baked(controller, args.tag)
            controller.close()
            daemon.stop()
            for name, reclaimed in (("kept", False), ("reclaimed", True)):
                report[name] = arm(daemon, args, reclaimed, device)
                print(f"{name}: stopped {report[name]['memory_stopped']['private_dirty_mib_mean']:.1f} MiB "
                      f"Private_Dirty a child, first eval after the stop "
                      f"{report[name]['eval_first_after_stop_ms'].get('p50', 0):.1f} ms p50", flush=True)
        finally:
            daemon.stop()
            if args.home is None:
                shutil.rmtree(home, ignore_errors=True)
    write_report(report, args.out, plot, ("swap", "kept", "reclaimed"))


if __name__ == "__main__":
    main()
