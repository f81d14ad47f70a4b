"""Where a pool-off fork's time and CPU go: per spawn stage, the wall time, the child VMM's CPU time and
the daemon's, for single forks until the child answered a numpy eval.

Per fork (``--repeats``, pool of ``--tag`` emptied first): a sampler thread looks in /proc every
``--sample-ms`` for the child's QEMU (a new process whose command line names this home's sandboxes
directory) and records its utime + stime with a monotonic time stamp, and the daemon's. The fork
answers with its per-stage timings (ms since the request arrived, runtime/timings.py), laid on the same
clock from the moment the request was sent; a stage's CPU is the sampled CPU at its end minus at its
start (so within one sample period). After the fork answers, one numpy eval is timed: the first answer
a user sees. The load average is recorded before and after; take figures on an idle machine only.

    FORKD_HOME=... .venv/bin/python bench/fork_cpu.py --tag quickstart --repeats 10

Writes bench/results/fork_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from forkd.config import paths_from_env  # noqa: E402
from forkd.sdk.autostart import ensure_daemon  # noqa: E402
from forkd.sdk.controller import Controller  # noqa: E402

RESULTS = Path(__file__).with_name("results")
NUMPY_PROBE = "float(numpy.ones(4).sum())"
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def cpu_ms(pid: int) -> float | None:
    """utime + stime of ``pid`` in ms, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_MS  # fields 14 and 15 of stat, after "pid (comm)"


def daemon_pid(socket: Path) -> int:
    """The process listening on the daemon's Unix socket (by its inode in /proc/net/unix)."""
    inode = next(line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
                 if line.split()[-1] == str(socket))
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]" for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    raise SystemExit(f"no process serves {socket}")


class Sampler(threading.Thread):
    """CPU time series of the daemon and of every new VMM under ``sandboxes`` until stopped."""

    def __init__(self, sandboxes: Path, daemon: int, period_s: float) -> None:
        super().__init__(daemon=True)
        self.sandboxes, self.daemon, self.period_s = str(sandboxes), daemon, period_s
        self.known = {int(p) for p in os.listdir("/proc") if p.isdigit()}
        self.series: dict[str, list[tuple[float, float]]] = {"daemon": []}
        self.vmm: int | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = time.monotonic()
            if self.vmm is None:
                for pid in {int(p) for p in os.listdir("/proc") if p.isdigit()} - self.known:
                    try:
                        if self.sandboxes in Path(f"/proc/{pid}/cmdline").read_text():
                            self.vmm = pid
                            self.series["vmm"] = [(now, 0.0)]  # not yet exec'd when first seen: CPU counts from 0
                    except OSError:
                        pass
            for name, pid in (("daemon", self.daemon), ("vmm", self.vmm)):
                if pid is not None and (ms := cpu_ms(pid)) is not None:
                    self.series[name].append((now, ms))
            time.sleep(self.period_s)

    def at(self, name: str, moment: float) -> float:
        """CPU ms of ``name`` at ``moment`` (the last sample before it; 0 before the process was seen)."""
        before = [ms for at, ms in self.series.get(name, []) if at <= moment]
        return before[-1] if before else 0.0


def one_fork(controller: Controller, tag: str, sandboxes: Path, daemon: int, period_s: float) -> dict[str, Any]:
    sampler = Sampler(sandboxes, daemon, period_s)
    sampler.start()
    sent = time.monotonic()
    child = controller.fork(tag, 1)["sandboxes"][0]
    answered = time.monotonic()
    value = controller.eval(child["id"], NUMPY_PROBE)
    evaluated = time.monotonic()
    time.sleep(2 * period_s)
    sampler.done.set()
    sampler.join()
    controller.kill(child["id"])
    assert value["value_json"] == 4.0, value
    stages: dict[str, dict[str, float]] = {}
    start = sent
    for stage, ms in child["timings"].items():
        if stage == "total":
            continue
        end = start + ms / 1000
        stages[stage] = {"wall_ms": ms, "vmm_cpu_ms": sampler.at("vmm", end) - sampler.at("vmm", start),
                         "daemon_cpu_ms": sampler.at("daemon", end) - sampler.at("daemon", start)}
        start = end
    stages["first_eval"] = {"wall_ms": (evaluated - answered) * 1000,
                            "vmm_cpu_ms": sampler.at("vmm", evaluated) - sampler.at("vmm", answered),
                            "daemon_cpu_ms": sampler.at("daemon", evaluated) - sampler.at("daemon", answered)}
    return {"fork_s": answered - sent, "fork_to_eval_s": evaluated - sent, "stages": stages,
            "vmm_cpu_ms": sampler.at("vmm", evaluated), "sample_ms": period_s * 1000}


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    names = list(runs[0]["stages"])
    return {name: {k: round(statistics.median(r["stages"][name][k] for r in runs if name in r["stages"]), 1)
                   for k in ("wall_ms", "vmm_cpu_ms", "daemon_cpu_ms")} for name in names}


def plot(summary: dict[str, dict[str, float]], path: Path) -> None:
    names = list(summary)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    x = range(len(names))
    for shift, key, label in ((-0.27, "wall_ms", "wall"), (0, "vmm_cpu_ms", "VMM CPU"),
                              (0.27, "daemon_cpu_ms", "daemon CPU")):
        ax.bar([i + shift for i in x], [summary[n][key] for n in names], width=0.27, label=label)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set(ylabel="ms (p50)", title="one pool-off fork until its first numpy eval: time and CPU per stage")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="quickstart")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument("--out", default="fork_cpu")
    args = parser.parse_args()
    paths = paths_from_env()
    controller = ensure_daemon(paths)
    controller.set_pool_size(args.tag, 0)
    daemon = daemon_pid(paths.socket)
    data: dict[str, Any] = {"tag": args.tag, "host": controller.version(), "load_average_before": os.getloadavg()}
    runs = [one_fork(controller, args.tag, paths.sandboxes, daemon, args.sample_ms / 1000) for _ in range(args.repeats)]
    data["runs"] = runs
    data["stages_p50"] = medians(runs)
    data["fork_s_p50"] = statistics.median(r["fork_s"] for r in runs)
    data["fork_to_eval_s_p50"] = statistics.median(r["fork_to_eval_s"] for r in runs)
    data["vmm_cpu_ms_p50"] = statistics.median(r["vmm_cpu_ms"] for r in runs)
    data["load_average_after"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=2))
    plot(data["stages_p50"], RESULTS / f"{args.out}.png")
    print(json.dumps({k: v for k, v in data.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
