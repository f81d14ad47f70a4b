"""Fork from a warm snapshot vs cold boot, side by side in one run; memory per live child; eval round trip.

A child counts as ready when its agent has answered an eval that uses numpy; memory is read from
/proc/<vmm-pid>/smaps_rollup while every child of the batch is alive. Cold boots use the same image,
machine and QEMU through the VMM backend directly (no daemon in their path, which favours them).

    .venv/bin/python bench/fork_vs_cold.py --tag quickstart -n 10 --repeats 3 --scale 100

Writes bench/results/fork_vs_cold.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from figures import plt, save  # bench/figures.py, next to this script

from forkd.config import paths_from_env
from forkd.guest import protocol
from forkd.image.builder import load_image
from forkd.runtime.agent_client import connect_when_answering
from forkd.runtime.snapshots import BASE_CMDLINE
from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller
from forkd.vmm.base import BootSpec
from forkd.vmm.process import read_memory_stats
from forkd.vmm.qemu import QemuVmm

NUMPY_PROBE = "float(numpy.ones(4).sum())"
RESULTS = Path(__file__).with_name("results")


def fork_batch(controller: Controller, tag: str, n: int) -> dict[str, Any]:
    """Fork ``n`` children, wait until each answers a numpy eval, measure memory, kill them."""
    started = time.monotonic()
    result = controller.fork(tag, n)
    ids = [child["id"] for child in result["sandboxes"]]
    with ThreadPoolExecutor(max_workers=min(32, max(1, n))) as pool:  # one eval in flight per child
        answers = list(pool.map(lambda sandbox_id: controller.eval(sandbox_id, NUMPY_PROBE), ids))
    assert all(answer["value_json"] == 4.0 for answer in answers), answers
    ready_s = time.monotonic() - started
    memory = [controller.sandbox(sandbox_id)["memory"] for sandbox_id in ids]
    round_trips = []
    for sandbox_id in ids[:3]:
        for _ in range(30):
            t0 = time.perf_counter()
            controller.eval(sandbox_id, "1")
            round_trips.append(time.perf_counter() - t0)
    for sandbox_id in ids:
        controller.kill(sandbox_id)
    return {
        "n": n,
        "answered": len(ids),
        "errors": result["errors"],
        "all_ready_s": ready_s,
        "first_answer_s": sorted(child["seconds_to_answer"] for child in result["sandboxes"]),
        "pss_mib_per_child": sum(m["pss_kib"] for m in memory) / 1024 / max(1, len(ids)),
        "private_dirty_mib_per_child": sum(m["private_dirty_kib"] for m in memory) / 1024 / max(1, len(ids)),
        "eval_round_trip_ms": [rt * 1000 for rt in round_trips],
    }


async def cold_batch(image_name: str, n: int, memory_mib: int) -> dict[str, Any]:
    """Boot ``n`` VMs from the image at once and wait until each answers the same numpy eval."""
    paths = paths_from_env()
    image = load_image(paths, image_name)
    vmm = QemuVmm()
    spec = BootSpec(kernel=image.kernel, initrd=image.initrd, cmdline=f"{BASE_CMDLINE} forkd.hostname=cold",
                    memory_mib=memory_mib, vcpus=1, kernel_sha256=image.kernel_sha256,
                    agent_version=image.agent_version)
    with tempfile.TemporaryDirectory(prefix="forkd-cold-", dir="/var/tmp") as scratch:
        async def one(index: int) -> tuple[float, int, int]:
            run_dir = Path(scratch) / f"vm{index}"
            run_dir.mkdir()
            vm = await vmm.boot(f"cold{index}", spec, run_dir, image.rootfs, run_dir / "memory")
            agent, _ = await connect_when_answering(vm, 600)
            try:
                await agent.call(protocol.OP_WARM, {"modules": ["numpy"]}, timeout=600)
                await agent.call(protocol.OP_EVAL, {"expr": NUMPY_PROBE}, timeout=60)
                ready = time.monotonic() - started
                stats = read_memory_stats(vm.pid)
                return ready, stats.pss_kib, stats.private_dirty_kib
            finally:
                await agent.close()
                await vmm.kill(vm)

        started = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(n)))
    return {"n": n, "all_ready_s": max(r[0] for r in results),
            "pss_mib_per_vm": sum(r[1] for r in results) / 1024 / n,
            "private_dirty_mib_per_vm": sum(r[2] for r in results) / 1024 / n}


def plot(report: dict[str, Any], out: Path) -> None:
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = ["fork (warm snapshot)", "cold boot"]
    medians = [report["fork"]["median_all_ready_s"], report["cold"]["median_all_ready_s"]]
    ax_time.bar(labels, medians, color=["tab:green", "tab:gray"])
    ax_time.set_ylabel(f"seconds until all {report['n']} answer a numpy eval (median)")
    ax_time.set_yscale("log")
    for x, value in enumerate(medians):
        ax_time.text(x, value, f"{value:.2f} s", ha="center", va="bottom")
    ax_time.set_title(f"ratio cold/fork = {report['ratio_cold_over_fork']:.1f}x")
    mem_labels = ["fork PSS", "fork Private_Dirty", "cold PSS", "cold Private_Dirty"]
    mem_values = [report["fork"]["median_pss_mib_per_child"], report["fork"]["median_private_dirty_mib_per_child"],
                  report["cold"]["median_pss_mib_per_vm"], report["cold"]["median_private_dirty_mib_per_vm"]]
    ax_mem.bar(mem_labels, mem_values, color=["tab:green", "tab:olive", "tab:gray", "silver"])
    ax_mem.set_ylabel("MiB per live VM (median)")
    ax_mem.tick_params(axis="x", labelrotation=20)
    for x, value in enumerate(mem_values):
        ax_mem.text(x, value, f"{value:.0f}", ha="center", va="bottom")
    save(fig, out, f"forkd on {report['host']['accelerator']} ({report['host']['vmm']} {report['host']['vmm_version']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="quickstart", help="warm snapshot to fork from")
    parser.add_argument("--image", default="default")
    parser.add_argument("-n", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=int, default=0, help="also fork this many at once and keep them alive")
    args = parser.parse_args()

    controller = ensure_daemon()
    version = controller.version()
    snapshot = controller.snapshot(args.tag)
    forks, colds = [], []
    for repeat in range(args.repeats):  # interleaved so machine noise hits both alike
        forks.append(fork_batch(controller, args.tag, args.n))
        print(f"repeat {repeat}: fork all ready in {forks[-1]['all_ready_s']:.2f} s", flush=True)
        colds.append(asyncio.run(cold_batch(args.image, args.n, snapshot["boot"]["memory_mib"])))
        print(f"repeat {repeat}: cold all ready in {colds[-1]['all_ready_s']:.2f} s", flush=True)
    med = statistics.median
    report: dict[str, Any] = {
        "n": args.n, "repeats": args.repeats, "snapshot": args.tag,
        "host": {"accelerator": version["accelerator"], "vmm": version["vmm"], "vmm_version": version["vmm_version"]},
        "fork": {
            "median_all_ready_s": med(f["all_ready_s"] for f in forks),
            "median_first_answer_s": med(s for f in forks for s in f["first_answer_s"]),
            "median_pss_mib_per_child": med(f["pss_mib_per_child"] for f in forks),
            "median_private_dirty_mib_per_child": med(f["private_dirty_mib_per_child"] for f in forks),
            "eval_round_trip_ms_p50": med(rt for f in forks for rt in f["eval_round_trip_ms"]),
            "eval_round_trip_ms_p90": statistics.quantiles([rt for f in forks for rt in f["eval_round_trip_ms"]],
                                                           n=10)[-1],
            "runs": forks,
        },
        "cold": {
            "median_all_ready_s": med(c["all_ready_s"] for c in colds),
            "median_pss_mib_per_vm": med(c["pss_mib_per_vm"] for c in colds),
            "median_private_dirty_mib_per_vm": med(c["private_dirty_mib_per_vm"] for c in colds),
            "runs": colds,
        },
    }
    report["ratio_cold_over_fork"] = report["cold"]["median_all_ready_s"] / report["fork"]["median_all_ready_s"]
    if args.scale:
        report["scale"] = fork_batch(controller, args.tag, args.scale)
        print(f"scale: {report['scale']['answered']}/{args.scale} answering in "
              f"{report['scale']['all_ready_s']:.1f} s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fork_vs_cold.json").write_text(json.dumps(report, indent=2))
    plot(report, RESULTS / "fork_vs_cold.png")
    summary = {k: v for k, v in report["fork"].items() if k != "runs"}
    print(json.dumps({"ratio_cold_over_fork": report["ratio_cold_over_fork"], "fork": summary,
                      "cold": {k: v for k, v in report["cold"].items() if k != "runs"}}, indent=2))


if __name__ == "__main__":
    main()
