"""Density: N children alive at once on this host, with idle stops off and on side by side in one run.

The bench runs its own daemon on its own home (the image cache is shared), bakes ``--tag`` there if
it is missing (the quickstart's settings: 1 GiB, numpy warm), then:

1. **idle stops off** (``idle_stop_s = 0``): forks ``--n`` children in requests of ``--batch`` (the
   time of each request and of all); pings every child (how many answer); after ``--settle`` s an
   idle-CPU window of ``--window`` s (utime + stime of every VMM from /proc, so a loaded machine
   distorts it least: a core's share per child and the cores all of them burn); Private_Dirty per
   child with its breakdown by mapping (/proc/PID/smaps: TCG translation cache, guest RAM copied on
   write, QEMU heap, other anonymous memory (glibc arenas, device state), files); eval round trips
   (p50/p90) on ``--sample`` random children while all are alive.
2. **idle stops on**: the daemon stops, leaving its VMMs (``keep_on_stop``); a daemon with
   ``idle_stop_s = --idle-stop`` re-adopts them and stops each once idle; when all are stopped, the
   same CPU window; then evals on a random sample again, each the first request after its stop
   (``cont``, the clock set, the eval).

3. **the fork again, idle stops on**: phase 2's children killed, ``--n`` forked as in phase 1 by the
   daemon that stops a child idle for ``--idle-stop`` s: side by side with phase 1, what the children
   already alive cost the later requests.

``--stops-on-only`` runs phase 1 alone on a daemon stopping a child idle for ``--idle-stop`` s (as a
daemon does by default): the density a user gets where idle children without stops saturate the host
before ``--n`` are alive. The window starts once every child the pings woke is stopped again. Its
report holds that phase as ``stopping``.

Each fork request records its children's median stage timings (``queued``, ``reseed``, …) and the
host's CPU over it split into the daemon, the children alive before it, the children it made, and
the rest (kernel threads, this bench), with the kernel's share of all of it (/proc/stat) and the
processes the rest went to.

The load average is recorded before and after every phase; take figures on an idle machine only.
Everything the bench started is killed at the end (its daemon kills its children when it stops).

    .venv/bin/python bench/density.py --n 500 --batch 50 --window 30 --sample 50

Writes bench/results/density.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from figures import load_span, plt, save  # bench/figures.py, next to this script
from spawn import load, quantiles, smaps_breakdown  # bench/spawn.py

from forkd.sdk.controller import Controller, DaemonUnreachable
from forkd.vmm.process import processes_under
from forkd.vmm.qemu_machine import QEMU_BINARY

RESULTS = Path(__file__).with_name("results")
TICKS = os.sysconf("SC_CLK_TCK")
START_BOUND_S = 600.0  # a daemon re-adopting hundreds of children answers late


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


class BenchDaemon:
    """``forkd daemon`` on the bench's home, its config file rewritten before each start."""

    def __init__(self, home: Path, n: int) -> None:
        self.home = home
        self.n = n
        self.socket = home / "forkd.sock"
        self.process: subprocess.Popen[bytes] | None = None
        self.keeps = False  # whether the running daemon leaves its children when it stops

    def start(self, idle_stop_s: float, keep_on_stop: bool, idle_reclaim: bool = True) -> Controller:
        (self.home / "forkd.toml").write_text(
            f"[limits]\nmax_sandboxes = {self.n + 16}\n\n"
            f"[sandboxes]\nidle_stop_s = {idle_stop_s}\nkeep_on_stop = {str(keep_on_stop).lower()}\n"
            f"idle_reclaim = {str(idle_reclaim).lower()}\n")
        env = {**os.environ, "FORKD_HOME": str(self.home), "FORKD_SOCKET": str(self.socket),
               "FORKD_CONFIG": str(self.home / "forkd.toml")}
        for variable in ("FORKD_URL", "FORKD_LISTEN", "FORKD_E2B_LISTEN", "FORKD_IDLE_STOP_S"):
            env.pop(variable, None)
        with open(self.home / "daemon.log", "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "forkd", "daemon"], env=env, stdout=log, stderr=log)
        self.keeps = keep_on_stop
        controller = Controller(url=f"unix://{self.socket}")
        deadline = time.monotonic() + START_BOUND_S
        while True:
            try:
                controller.health()
                return controller
            except DaemonUnreachable:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"the bench daemon did not start; see {self.home / 'daemon.log'}") from None
                time.sleep(0.2)

    def stop(self, leave_children: bool = False) -> None:
        """Stop the daemon; its children die with it unless ``leave_children`` (for the next daemon)."""
        if self.process is None:
            return
        if self.keeps and not leave_children:  # a bench that failed half-way leaves nothing running
            with contextlib.suppress(Exception), Controller(url=f"unix://{self.socket}") as controller:
                for sandbox in controller.sandboxes():
                    with contextlib.suppress(Exception):
                        controller.kill(sandbox["id"])
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=START_BOUND_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None
        if not leave_children and (left := kill_left_behind(self.home / "sandboxes")):
            print(f"killed {left} VMMs the daemon left running under {self.home}", flush=True)

    def idle_stopped(self) -> int:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), timeout=60) as client:
            text = client.get("http://forkd/metrics").text
        return int(float(next(line.split()[1] for line in text.splitlines()
                              if line.startswith("forkd_sandboxes_idle_stopped "))))


def kill_left_behind(sandboxes: Path) -> int:
    """Kill the VMMs a stopped daemon left running under ``sandboxes``: one that exits without killing
    its children (a second SIGTERM, the kill after START_BOUND_S) leaves them for re-adoption, and a
    bench that then removes its home would leave them orphaned. Found as the daemon's recovery finds
    them (the QEMU binary naming a directory under ``sandboxes``)."""
    left = {ref.pid for ref in processes_under(sandboxes, Path(QEMU_BINARY).name)}
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(left)


def bench_home(args: argparse.Namespace, name: str) -> Path:
    """The bench daemon's home: ``--home``, or a new directory (removed at the end); a ``timeout``
    sending SIGTERM still runs the clean-up."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    home = args.home or Path(tempfile.mkdtemp(prefix=f"forkd-{name}-", dir="/var/tmp"))
    home.mkdir(parents=True, exist_ok=True)
    return home


def baked(controller: Controller, tag: str) -> dict[str, Any]:
    """The host's accelerator and VMM; ``tag`` baked first if this home lacks it (the quickstart's settings)."""
    version = controller.version()
    if not any(s["tag"] == tag for s in controller.snapshots()):
        controller.build_image(name="default")  # reused when it is the one this forkd builds
        controller.create_snapshot(tag, on_progress=lambda line: print(f"[bake] {line}", flush=True))
    return {k: version[k] for k in ("accelerator", "vmm", "vmm_version")}


def write_report(report: dict[str, Any], out: str, plot: Callable[[dict[str, Any], Path], None],
                 shown: tuple[str, ...]) -> None:
    """bench/results/OUT.json and .png, the load at the end recorded; the ``shown`` parts printed."""
    report["load_end"] = load()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{out}.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / f"{out}.png")
    print(json.dumps({k: report[k] for k in ("load_start", "load_end", *shown)}, indent=2))


def host_cpu_seconds() -> tuple[float, float]:
    """(busy, of which in the kernel) CPU seconds of the whole host so far, all cores (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICKS, (system + irq + softirq) / TICKS


def process_cpu() -> dict[int, tuple[str, float]]:
    """Every process's (name, CPU seconds so far), kernel threads included."""
    seen = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            fields = text.rsplit(")", 1)[1].split()
            seen[int(stat.parent.name)] = (text[text.index("(") + 1:text.rindex(")")],
                                           (int(fields[11]) + int(fields[12])) / TICKS)
    return seen


def top_others(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], known: set[int],
               top: int = 6) -> dict[str, float]:
    """CPU seconds of the processes that are neither the daemon nor a child, by name (kernel threads'
    per-CPU suffixes folded: ``kworker/1:2`` → ``kworker``), the ``top`` largest."""
    spent: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        if pid in known:
            continue
        used = seconds - before.get(pid, (name, 0.0))[1]
        if used > 0:
            key = name.split("/")[0]
            spent[key] = spent.get(key, 0.0) + used
    return {name: round(used, 2) for name, used in sorted(spent.items(), key=lambda kv: -kv[1])[:top]}


def request_cpu(daemon_pid: int, alive: list[int], fork: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run one fork request and split the host's CPU over it: the daemon, the children alive before it
    (idle), the children it made (their whole life so far) and the rest (the kernel's threads, this bench);
    with the kernel's share of all of it. Where the time of a request goes as children pile up."""
    busy0, kernel0 = host_cpu_seconds()
    daemon0 = cpu_seconds(daemon_pid) or 0.0
    before = {pid: cpu_seconds(pid) for pid in alive}
    processes = process_cpu()
    t0 = time.monotonic()
    result = fork()
    elapsed = time.monotonic() - t0
    new_pids = {child["pid"] for child in result["sandboxes"] if child.get("pid")}
    others = top_others(processes, process_cpu(), {daemon_pid, *alive, *new_pids})
    busy, kernel = (a - b for a, b in zip(host_cpu_seconds(), (busy0, kernel0)))
    idle_children = sum((cpu_seconds(pid) or start) - start for pid, start in before.items() if start is not None)
    new_children = sum(cpu_seconds(child["pid"]) or 0.0 for child in result["sandboxes"] if child.get("pid"))
    daemon = (cpu_seconds(daemon_pid) or daemon0) - daemon0
    split = {"wall_s": elapsed, "host_busy_s": busy, "host_kernel_s": kernel, "daemon_s": daemon,
             "idle_children_s": idle_children, "new_children_s": new_children,
             "rest_s": busy - daemon - idle_children - new_children}
    return result, {**{k: round(v, 3) for k, v in split.items()}, "rest_by_process_s": others}


def stage_medians(children: list[dict[str, Any]]) -> dict[str, float]:
    """The median milliseconds of each spawn stage over one request's children."""
    stages: dict[str, list[float]] = {}
    for child in children:
        for stage, ms in (child.get("timings") or {}).items():
            stages.setdefault(stage, []).append(ms)
    return {stage: round(sorted(values)[len(values) // 2], 1) for stage, values in stages.items()}


def fork_all(controller: Controller, daemon_pid: int, tag: str, n: int, batch: int) -> dict[str, Any]:
    """Fork ``n`` in requests of ``batch``, one after another (the earlier children stay alive); each
    request with its children's median stage timings and the host's CPU split over it."""
    ids: list[str] = []
    pids: list[int] = []
    errors: list[dict[str, Any]] = []
    requests = []
    started = time.monotonic()
    while len(ids) + len(errors) < n:
        count = min(batch, n - len(ids) - len(errors))
        t0 = time.monotonic()
        result, cpu = request_cpu(daemon_pid, pids, functools.partial(controller.fork, tag, count))
        requests.append({"n": count, "seconds": time.monotonic() - t0, "errors": len(result["errors"]),
                         "stage_ms_p50": stage_medians(result["sandboxes"]), "cpu_s": cpu})
        ids += [child["id"] for child in result["sandboxes"]]
        pids += [child["pid"] for child in result["sandboxes"] if child.get("pid")]
        errors += result["errors"]
        print(f"forked {len(ids)}/{n} ({len(errors)} failed), last request {requests[-1]['seconds']:.1f} s; "
              f"stages {requests[-1]['stage_ms_p50']}; cpu {cpu}", flush=True)
    return {"ids": ids, "errors": errors[:10], "failed": len(errors), "requests": requests,
            "total_s": time.monotonic() - started}


def answering(controller: Controller, ids: list[str]) -> int:
    def ping(sandbox_id: str) -> bool:
        try:
            controller.ping(sandbox_id)
            return True
        except Exception:
            return False

    with ThreadPoolExecutor(max_workers=16) as pool:
        return sum(pool.map(ping, ids))


def idle_cpu(pids: list[int], window_s: float) -> dict[str, Any]:
    """CPU the VMMs used over ``window_s``: per child (share of a core) and all together (cores)."""
    before = {pid: cpu_seconds(pid) for pid in pids}
    t0 = time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - t0
    used = [(cpu_seconds(pid) or 0.0) - start for pid, start in before.items() if start is not None]
    shares = [u / elapsed for u in used]
    return {"window_s": elapsed, "children": len(shares), "cores_total": sum(shares),
            "core_share_per_child": {**quantiles(shares), "mean": sum(shares) / max(1, len(shares))}}


def memory(pids: list[int], memory_file: str) -> dict[str, Any]:
    per_child = []
    for pid in pids:
        with contextlib.suppress(OSError):
            per_child.append(smaps_breakdown(pid, memory_file))
    n = max(1, len(per_child))
    breakdown = {k: round(sum(c[k] for c in per_child) / n, 2) for k in (per_child[0] if per_child else {})}
    return {"children": len(per_child), "private_dirty_mib_mean": round(sum(breakdown.values()), 2),
            "private_dirty_breakdown_mib_mean": breakdown,
            "private_dirty_mib": quantiles([sum(c.values()) for c in per_child])}


def eval_latency(controller: Controller, ids: list[str], sample: int, seed: int) -> dict[str, Any]:
    """``1 + 1`` on random children: the first eval on each (a child idle until then: its VMM's
    caches cold, its threads asleep), and a second one right after it (warm), to tell the two apart."""
    chosen = random.Random(seed).sample(ids, min(sample, len(ids)))
    first, again, failed = [], [], 0
    for sandbox_id in chosen:
        try:
            for times in (first, again):
                t0 = time.perf_counter()
                controller.eval(sandbox_id, "1 + 1")
                times.append((time.perf_counter() - t0) * 1000)
        except Exception:
            failed += 1
    return {**quantiles(first), "again": quantiles(again), "failed": failed}


def phase_alive(controller: Controller, daemon_pid: int, args: argparse.Namespace, memory_file: str,
                settle: Callable[[int], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Fork ``--n``, ping each, then the idle-CPU window, memory and evals while all are alive (phase 1,
    and ``--stops-on-only``'s one phase). ``settle`` (given how many answered) waits before the window
    instead of ``--settle`` s; what it returns is recorded as ``settled``."""
    load_before = load()
    forked = fork_all(controller, daemon_pid, args.tag, args.n, args.batch)
    ids = forked.pop("ids")
    pids = {s["id"]: s["pid"] for s in controller.sandboxes()}
    answered = answering(controller, ids)
    settled = None
    if settle is None:
        time.sleep(args.settle)
    else:
        settled = settle(answered)
    cpu = idle_cpu([pids[i] for i in ids if i in pids], args.window)
    mem = memory([pids[i] for i in ids if i in pids], memory_file)
    evals = eval_latency(controller, ids, args.sample, seed=1)
    return {"ids": ids, "fork": forked, "answered": answered, "settled": settled, "idle_cpu": cpu, "memory": mem,
            "eval_ms": evals, "load_before": load_before, "load_after": load()}


def wait_all_stopped(daemon: BenchDaemon, count: int, args: argparse.Namespace) -> dict[str, Any]:
    """Until ``count`` children are idle-stopped, bounded (an agent without `activity` is never stopped:
    a snapshot baked by an older forkd): the window then holds idle children, not their stops."""
    t0 = time.monotonic()
    deadline = t0 + 120 + 10 * args.idle_stop + 0.5 * count
    while (stopped := daemon.idle_stopped()) < count and time.monotonic() < deadline:
        time.sleep(1.0)
    return {"stopped": stopped, "after_s": time.monotonic() - t0}


def phase_on(daemon: BenchDaemon, controller: Controller, ids: list[str], args: argparse.Namespace) -> dict[str, Any]:
    load_before = load()
    alive = {s["id"]: s["pid"] for s in controller.sandboxes()}
    adopted = [i for i in ids if i in alive]
    settled = wait_all_stopped(daemon, len(adopted), args)
    cpu = idle_cpu([alive[i] for i in adopted], args.window)
    evals = eval_latency(controller, adopted, args.sample, seed=2)  # each the first request after its stop
    return {"adopted": len(adopted), "stopped": settled["stopped"], "all_stopped_after_s": settled["after_s"],
            "idle_cpu": cpu,
            "eval_after_stop_ms": evals, "load_before": load_before, "load_after": load()}


def phase_fork_stopping(controller: Controller, daemon_pid: int, ids: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The fork of phase 1 again with idle stops on (the children of phase 2 killed first): side by side,
    how much of the slowdown as children pile up is the CPU of the ones already alive."""
    for sandbox_id in ids:
        with contextlib.suppress(Exception):
            controller.kill(sandbox_id)
    load_before = load()
    forked = fork_all(controller, daemon_pid, args.tag, args.n, args.batch)
    forked.pop("ids")
    return {"fork": forked, "load_before": load_before, "load_after": load()}


def plot(report: dict[str, Any], out: Path) -> None:
    off, on = report["off"], report["on"]
    fig, (ax_cpu, ax_mem, ax_eval, ax_fork) = plt.subplots(1, 4, figsize=(19, 4.5))
    ax_cpu.bar(["idle stops off", "idle stops on"],
               [100 * off["idle_cpu"]["core_share_per_child"]["mean"], 100 * on["idle_cpu"]["core_share_per_child"]["mean"]],
               color=["tab:gray", "tab:green"])
    ax_cpu.set_ylabel(f"% of a core per idle child ({off['idle_cpu']['window_s']:.0f} s window)")
    breakdown = off["memory"]["private_dirty_breakdown_mib_mean"]
    bottom = 0.0
    for kind, mib in breakdown.items():
        ax_mem.bar(["per child"], [mib], bottom=bottom, label=kind)
        bottom += mib
    ax_mem.set_ylabel(f"Private_Dirty MiB, mean of {off['memory']['children']} children")
    ax_mem.legend(fontsize=8)
    labels = ["running", "after idle stop"]
    ax_eval.bar([0, 1], [off["eval_ms"].get("p50", 0), on["eval_after_stop_ms"].get("p50", 0)], width=0.4,
                label="p50")
    ax_eval.bar([0.4, 1.4], [off["eval_ms"].get("p90", 0), on["eval_after_stop_ms"].get("p90", 0)], width=0.4,
                label="p90")
    ax_eval.set_xticks([0.2, 1.2], labels)
    ax_eval.set_ylabel(f"eval round trip ms, {report['n']} alive")
    ax_eval.legend(fontsize=8)
    for label, requests in (("idle stops off", off["fork"]["requests"]),
                            (f"idle stops after {report['idle_stop_s']:g} s", report["fork_stopping"]["fork"]["requests"])):
        done = 0
        xs, ys = [], []
        for request in requests:
            done += request["n"]
            xs.append(done)
            ys.append(request["seconds"])
        ax_fork.plot(xs, ys, marker="o", label=label)
    ax_fork.legend(fontsize=8)
    ax_fork.set_xlabel("children alive after the request")
    ax_fork.set_ylabel(f"seconds per request of {report['batch']}")
    save(fig, out, f"forkd density: {off['answered']}/{report['n']} answer ({load_span(report)})")


def plot_stopping(report: dict[str, Any], out: Path) -> None:
    """``--stops-on-only``: each request's time as children pile up, and the eval round trips among them."""
    phase = report["stopping"]
    fig, (ax_fork, ax_eval) = plt.subplots(1, 2, figsize=(11, 4.5))
    alive, seconds = [], []
    for request in phase["fork"]["requests"]:
        alive.append((alive[-1] if alive else 0) + request["n"])
        seconds.append(request["seconds"])
    ax_fork.plot(alive, seconds, marker="o")
    ax_fork.set_ylim(bottom=0)
    ax_fork.set_xlabel("children alive after the request")
    ax_fork.set_ylabel(f"seconds per request of {report['batch']}")
    evals = phase["eval_ms"]
    ax_eval.bar(["first p50", "first p90", "again p50", "again p90"],
                [evals.get("p50", 0), evals.get("p90", 0), evals["again"].get("p50", 0), evals["again"].get("p90", 0)])
    ax_eval.set_ylabel(f"eval round trip ms, {phase['answered']} alive")
    save(fig, out, f"forkd density, idle stops after {report['idle_stop_s']:g} s: "
                   f"{phase['answered']}/{report['n']} answer ({load_span(report)})")


def run_stopping_only(daemon: BenchDaemon, args: argparse.Namespace, report: dict[str, Any]) -> None:
    controller = daemon.start(idle_stop_s=args.idle_stop, keep_on_stop=False)
    report["host"] = baked(controller, args.tag)
    memory_file = str(Path(controller.snapshot(args.tag)["path"]) / "memory")
    assert daemon.process is not None
    phase = phase_alive(controller, daemon.process.pid, args, memory_file,
                        settle=lambda answered: wait_all_stopped(daemon, answered, args))
    phase.pop("ids")
    report["stopping"] = phase
    controller.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="children alive at once")
    parser.add_argument("--batch", type=int, default=50, help="children per fork request")
    parser.add_argument("--tag", default="density", help="snapshot forked (baked in the bench home if missing)")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of each idle-CPU window")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds between the last fork and the window")
    parser.add_argument("--sample", type=int, default=50, help="children whose eval round trip is timed")
    parser.add_argument("--idle-stop", type=float, default=5.0, help="idle_stop_s of the 'on' phase")
    parser.add_argument("--home", type=Path, help="the bench daemon's FORKD_HOME (default: a new one, removed)")
    parser.add_argument("--stops-on-only", action="store_true",
                        help="only fork --n with idle stops on (as a daemon runs by default) and measure them")
    parser.add_argument("--out", default="density")
    args = parser.parse_args()

    home = bench_home(args, "density")
    daemon = BenchDaemon(home, args.n)
    report: dict[str, Any] = {"n": args.n, "batch": args.batch, "window_s": args.window, "idle_stop_s": args.idle_stop,
                              "cpus": os.cpu_count(), "load_start": load()}
    if args.stops_on_only:
        try:
            run_stopping_only(daemon, args, report)
        finally:
            daemon.stop()
            if args.home is None:
                shutil.rmtree(home, ignore_errors=True)
        write_report(report, args.out, plot_stopping, ("stopping",))
        return
    try:
        controller = daemon.start(idle_stop_s=0, keep_on_stop=True)
        report["host"] = baked(controller, args.tag)
        memory_file = str(Path(controller.snapshot(args.tag)["path"]) / "memory")
        assert daemon.process is not None
        off = phase_alive(controller, daemon.process.pid, args, memory_file)
        ids = off.pop("ids")
        report["off"] = off
        print(f"off: {off['answered']}/{args.n} answer, "
              f"{100 * off['idle_cpu']['core_share_per_child']['mean']:.3f} % of a core per idle child", flush=True)
        controller.close()
        daemon.stop(leave_children=True)  # keep_on_stop: the children stay for the next daemon
        controller = daemon.start(idle_stop_s=args.idle_stop, keep_on_stop=False)
        report["on"] = phase_on(daemon, controller, ids, args)
        print(f"on: {report['on']['stopped']}/{report['on']['adopted']} stopped, "
              f"{100 * report['on']['idle_cpu']['core_share_per_child']['mean']:.3f} % of a core per child", flush=True)
        assert daemon.process is not None
        report["fork_stopping"] = phase_fork_stopping(controller, daemon.process.pid, ids, args)
        controller.close()
    finally:
        daemon.stop()  # its children die with it (killed first if this daemon would keep them)
        if args.home is None:
            shutil.rmtree(home, ignore_errors=True)
    write_report(report, args.out, plot, ("off", "on", "fork_stopping"))


if __name__ == "__main__":
    main()
