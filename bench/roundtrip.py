"""One call's round trip, hop by hop: ping, eval and exec `true` on one child, through REST and straight to the agent.

Per snapshot tag, two children of it answer side by side in one run, the calls interleaved so machine
noise hits every path alike:

- ``rest``: a child the daemon forked, called over its Unix socket with a plain HTTP client (what the
  SDK does); each op is timed at the client, then once more with ``X-Forkd-Timings: 1``, whose
  ``Server-Timing`` answer gives the daemon's stages (``routed`` through ``answer_ready``) and the
  guest's (``guest.*``, on the guest's clock; ``transport`` is what the host waited beyond the guest's
  span: both ways through the VMM's port and the guest kernel).
- ``direct``: a child restored through the QEMU backend in this process (no daemon), called with an
  ``AgentClient``: the same calls without REST, so ``rest - direct`` is what REST costs.

Two tags (``--tags old new``, e.g. snapshots of images built before and after an agent change) compare
agents side by side; two daemons (``--daemons old=HOME new=HOME``, each with the tags in its own home,
e.g. one started from the code before a daemon change) compare daemons side by side. Medians and p90s
over ``-n`` calls per op and path; the stages are medians of the traced calls.

    FORKD_HOME=... .venv/bin/python bench/roundtrip.py --tags quickstart -n 200

Writes bench/results/roundtrip.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from forkd.config import Paths, paths_from_env  # noqa: E402
from forkd.guest import protocol  # noqa: E402
from forkd.runtime import timings as timings_module  # noqa: E402
from forkd.runtime.agent_client import AgentClient, connect_when_answering  # noqa: E402
from forkd.runtime.timings import Timings  # noqa: E402
from forkd.sdk.autostart import ensure_daemon  # noqa: E402
from forkd.sdk.connection import ConnectionConfig  # noqa: E402
from forkd.store.files import DigestCache  # noqa: E402
from forkd.store.registry import Registry  # noqa: E402
from forkd.store.snapshots import SnapshotStore  # noqa: E402
from forkd.vmm.base import VmHandle, restore  # noqa: E402
from forkd.vmm.qemu import QemuVmm  # noqa: E402

RESULTS = Path(__file__).with_name("results")
#: op name → (REST method path under /v1/sandboxes/{id}, REST body, agent op, agent args)
OPS: dict[str, tuple[str, dict[str, Any] | None, str, dict[str, Any]]] = {
    "ping": ("ping", None, protocol.OP_PING, {}),
    "eval": ("eval", {"expr": "1+1"}, protocol.OP_EVAL, {"expr": "1+1", "context": "default", "timeout_s": 60.0}),
    "exec": ("exec", {"argv": ["true"]}, protocol.OP_EXEC, {"argv": ["true"], "timeout_s": 60.0}),
}


def parse_server_timing(header: str) -> dict[str, float]:
    stages = {}
    for part in header.split(","):
        name, _, rest = part.strip().partition(";dur=")
        if name and rest:
            stages[name] = float(rest)
    return stages


class Rest:
    """A forked child called through the daemon's REST API on its Unix socket."""

    def __init__(self, client: httpx.Client, sandbox_id: str) -> None:
        self.client = client
        self.sandbox_id = sandbox_id

    async def call(self, op: str, traced: bool) -> dict[str, float]:
        path, body, _, _ = OPS[op]
        headers = {"x-forkd-timings": "1"} if traced else {}
        started = time.perf_counter()
        answer = self.client.post(f"/v1/sandboxes/{self.sandbox_id}/{path}", json=body, headers=headers)
        total = time.perf_counter() - started
        answer.raise_for_status()
        stages = parse_server_timing(answer.headers.get("server-timing", "")) if traced else {}
        if stages:
            stages["client"] = total * 1000 - stages["total"]  # HTTP both ways, outside the daemon's app
        return {"wall": total * 1000, **stages}

    async def uptime(self) -> float:
        answer = self.client.post(f"/v1/sandboxes/{self.sandbox_id}/ping")
        answer.raise_for_status()
        return float(answer.json()["uptime_s"])


class Direct:
    """A child restored in this process, called with an AgentClient (no daemon, no REST)."""

    def __init__(self, agent: AgentClient) -> None:
        self.agent = agent

    async def call(self, op: str, traced: bool) -> dict[str, float]:
        _, _, agent_op, args = OPS[op]
        timings = Timings() if traced else None
        token = timings_module.CURRENT.set(timings)
        try:
            started = time.perf_counter()
            await self.agent.call(agent_op, args, timeout=60)
            total = time.perf_counter() - started
        finally:
            timings_module.CURRENT.reset(token)
        return {"wall": total * 1000, **(timings.as_ms() if timings is not None else {})}

    async def uptime(self) -> float:
        return float((await self.agent.call(protocol.OP_PING, {}, timeout=60))["uptime_s"])


async def restored_child(snapshots: SnapshotStore, tag: str, scratch: Path, name: str) -> tuple[VmHandle, AgentClient]:
    _, saved, spec = await asyncio.to_thread(snapshots.open, tag)
    run_dir = scratch / name
    run_dir.mkdir()
    vm = await restore(QemuVmm(), name, saved, spec, run_dir)
    agent, _ = await connect_when_answering(vm, 120, protocol.OP_RESEED, {
        "entropy_b64": protocol.b64encode(os.urandom(64)), "time_ns": time.time_ns(),
        "hostname": name, "sandbox_id": name})
    return vm, agent


def summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    walls = sorted(s["wall"] for s in samples)
    return {"p50_ms": round(statistics.median(walls), 2), "p90_ms": round(walls[int(0.9 * (len(walls) - 1))], 2),
            "n": len(walls)}


def stage_medians(samples: list[dict[str, float]]) -> dict[str, float]:
    names = dict.fromkeys(name for s in samples for name in s if name != "wall")
    return {name: round(statistics.median(s[name] for s in samples if name in s), 3) for name in names}


def daemons(specs: list[str], paths: Paths) -> dict[str, Paths]:
    """``LABEL=HOME`` → that home's paths (its daemon's socket in it); none given: this environment's daemon."""
    if not specs:
        return {"rest": paths}
    found = {}
    for spec in specs:
        label, _, home = spec.partition("=")
        found[label] = Paths(home=Path(home), cache=paths.cache, socket=Path(home) / "forkd.sock")
    return found


async def run(args: argparse.Namespace) -> dict[str, Any]:
    paths = paths_from_env()
    vmm = QemuVmm()
    snapshots = SnapshotStore(paths.snapshots, Registry(paths.db), DigestCache(), vmm.identity, vmm.disk)
    paths_under_test: dict[str, Rest | Direct] = {}
    forked: list[tuple[Any, str]] = []
    clients: list[httpx.Client] = []
    restored: list[tuple[VmHandle, AgentClient]] = []
    with tempfile.TemporaryDirectory(prefix="forkd-roundtrip-", dir="/var/tmp") as scratch:
        try:
            for tag in args.tags:
                for label, home in daemons(args.daemons, paths).items():
                    api = ensure_daemon(home, ConnectionConfig.from_env(url=f"unix://{home.socket}"))
                    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(home.socket)), base_url="http://forkd",
                                        timeout=120)
                    clients.append(http)
                    sandbox_id = api.fork(tag, 1, timeout_s=3600)["sandboxes"][0]["id"]
                    forked.append((api, sandbox_id))
                    paths_under_test[f"{tag}/{label}"] = Rest(http, sandbox_id)
                vm, agent = await restored_child(snapshots, tag, Path(scratch), f"rt{len(restored)}")
                restored.append((vm, agent))
                paths_under_test[f"{tag}/direct"] = Direct(agent)
            samples: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {
                path: {op: {"plain": [], "traced": []} for op in OPS} for path in paths_under_test}
            for path, caller in paths_under_test.items():  # warm every path (the context's first cell forks it)
                for op in OPS:
                    for _ in range(args.warmup):
                        await caller.call(op, False)
            clocks = {path: (time.monotonic(), await caller.uptime()) for path, caller in paths_under_test.items()}
            order = [(path, op, traced) for path in paths_under_test for op in OPS for traced in (False, True)]
            shuffle = random.Random(0).shuffle  # every round in another order: no path always follows the same one
            for i in range(args.n):
                shuffle(order)
                for path, op, traced in order:
                    sample = await paths_under_test[path].call(op, traced)
                    samples[path][op]["traced" if traced else "plain"].append(sample)
                if (i + 1) % 50 == 0:
                    print(f"{i + 1}/{args.n} rounds", flush=True)
            rates = {}
            for path, caller in paths_under_test.items():
                host_at, guest_at = clocks[path]
                rates[path] = (await caller.uptime() - guest_at) / (time.monotonic() - host_at)
        finally:
            for api, sandbox_id in forked:
                api.kill(sandbox_id)
            for vm, agent in restored:
                await agent.close()
                await vmm.kill(vm)
            for http in clients:
                http.close()
    return {path: {op: {**summary(s["plain"]), "traced": summary(s["traced"]),
                        "stages_ms": stage_medians([on_host_clock(sample, rates[path]) for sample in s["traced"]])}
                   for op, s in ops.items()} | {"guest_clock_rate": round(rates[path], 4)}
            for path, ops in samples.items()}


def on_host_clock(sample: dict[str, float], rate: float) -> dict[str, float]:
    """The guest's stages in host milliseconds, and transport again from them.

    A TCG guest's clock need not run at the host's rate: its TSC frequency was calibrated once, when
    the snapshot's parent booted on a loaded host. ``rate`` is the guest's seconds per host second over
    the run (from ``ping``'s ``uptime_s`` at its start and end)."""
    if "guest" not in sample:
        return sample
    scaled = {name: ms / rate if name.startswith("guest") else ms for name, ms in sample.items()}
    scaled["transport"] = sample["agent_answer"] - scaled["guest"]
    return scaled


#: Stages stacked in the plot, in the order a call passes them (the daemon's, then the guest's inside "agent_answer").
HOST_STAGES = ("client", "routed", "awake", "agent_sent", "agent_answer", "agent_resumed", "answer_ready")


def plot(report: dict[str, Any], out: Path) -> None:
    figures = report["paths"]
    bars = [(path, op) for path in figures for op in OPS]  # (each path also has its guest_clock_rate)
    fig, (host_ax, guest_ax) = plt.subplots(1, 2, figsize=(15, 0.5 * len(bars) + 2.5))
    labels = [f"{path} {op}" for path, op in bars]
    for ax, stages_of in ((host_ax, lambda st: [(s, st.get(s, 0.0)) for s in HOST_STAGES if s in st]),
                          (guest_ax, lambda st: [("transport", st.get("transport", 0.0))]
                           + [(s, v) for s, v in st.items() if s.startswith("guest.")])):
        seen: dict[str, Any] = {}
        for row, (path, op) in enumerate(bars):
            left = 0.0
            for stage, ms in stages_of(figures[path][op]["stages_ms"]):
                colour = seen.setdefault(stage, f"C{len(seen) % 10}")
                ax.barh(row, ms, left=left, color=colour, label=stage if stage not in ax.get_legend_handles_labels()[1] else None)
                left += ms
            ax.text(left, row, f" p50 {figures[path][op]['p50_ms']} ms", va="center", fontsize=7)
        ax.set_yticks(range(len(bars)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.legend(fontsize=7, loc="lower right")
    host_ax.set_xlabel("ms (medians of traced calls; bar label: untraced p50)")
    host_ax.set_title("host stages: client, daemon, agent client")
    guest_ax.set_xlabel("ms")
    guest_ax.set_title("inside agent_answer: transport and the guest's stages")
    fig.suptitle(f"round trip hop by hop, n={report['n']}, load {report['load'][0]:.2f} → {report['load'][1]:.2f}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tags", nargs="+", default=["quickstart"], help="snapshots to compare (A/B: two tags)")
    parser.add_argument("--daemons", nargs="*", default=[], metavar="LABEL=HOME",
                        help="daemons to compare, each on its home's socket (default: FORKD_HOME's, as 'rest')")
    parser.add_argument("-n", type=int, default=200, help="calls per op and path (each plain and traced)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="roundtrip")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    paths = asyncio.run(run(args))
    report = {"tags": args.tags, "daemons": args.daemons, "n": args.n, "load": [load_before, os.getloadavg()[0]], "paths": paths}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / f"{args.out}.png")
    for path, ops in paths.items():
        print(f"{path}: guest clock rate {ops['guest_clock_rate']} guest s per host s")
        for op in OPS:
            fig = ops[op]
            print(f"{path:>24} {op:>5}: p50 {fig['p50_ms']:7.2f} ms  p90 {fig['p90_ms']:7.2f} ms  stages {fig['stages_ms']}")
    print(f"load {report['load'][0]:.2f} → {report['load'][1]:.2f}")


if __name__ == "__main__":
    main()
