"""What a VMM's private root (vmm/jail.py) adds to a jailed QEMU start: the same start, with and
without the root, interleaved (A, B, A, B, ...) so both see the same load.

One start is what a fork pays per child before its state loads: ``QemuMachine.start`` of a child-like
QEMU (``-S``, a backing chain, the image's kernel) until its monitor answers, then a kill. "without"
skips only building the root (``jail._pivot_into``, with its own ``/proc``): the VMM then sees the host's
tree; its namespaces, rlimits, ``-runas`` and seccomp stay. ``build_ms`` times building the root alone
(on the jail's thread); ``spawn_ms`` times the jail's part of a start without QEMU: ``Jail.spawn`` of
``true`` until it is started (namespaces, root, prlimit), with and without.
Record the load average around a run (it is in the JSON): figures from a busy machine do not compare.

    flock /tmp/forkd-vm.lock .venv/bin/python bench/jail_root.py --repeats 40

Writes bench/results/jail_root.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from figures import load_span, plt, save  # bench/figures.py, next to this script

from forkd.vmm import jail
from forkd.vmm.base import BootSpec
from forkd.vmm.jail import HostFile
from forkd.vmm.qemu import QemuVmm
from forkd.vmm.qemu_disk import create_overlay
from forkd.vmm.qemu_machine import kill

RESULTS = Path(__file__).with_name("results")
IMAGE = Path("/var/cache/forkd/images/default")


def summary(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {"values": values, "p50": statistics.median(values), "p90": ordered[round(0.9 * (len(ordered) - 1))],
            "mean": statistics.fmean(values)}


async def one_start(vmm: QemuVmm, home: Path, spec: BootSpec, layer: Path, memory: Path, n: int) -> float:
    run_dir = home / "sandboxes" / f"sb-{n}"
    run_dir.mkdir(parents=True)
    disk = run_dir / "disk.qcow2"
    await vmm.disk.new_child(layer, disk)
    started = time.perf_counter()
    files = vmm.machine.host_files(spec, [layer, IMAGE / "rootfs.ext4"], memory, share=False, boot=True)
    vm = await vmm.machine.start(f"bench-{n}", [*vmm.machine.argv(spec, run_dir, disk, memory, share=False,
                                                                  boot=True), "-S"], run_dir, disk, files=files)
    elapsed = time.perf_counter() - started
    await kill(vm)
    return elapsed


async def spawn_only(home: Path, files: list[HostFile], repeats: int) -> dict[str, Any]:
    """``Jail.spawn`` of ``true`` until it is started, with and without the root, interleaved."""
    run_dir = home / "sandboxes" / "spawn-only"
    run_dir.mkdir(parents=True)
    confined = jail.Jail()
    real = jail._pivot_into
    times: dict[str, list[float]] = {"with_root": [], "without_root": []}
    with open(home / "spawn.log", "wb") as log:
        try:
            for _ in range(repeats):
                for mode, values in times.items():
                    jail._pivot_into = real if mode == "with_root" else (lambda plan, mount_point: None)  # type: ignore
                    started = time.perf_counter()
                    process = await confined.spawn(lambda uid: ["true"], ("setuid", "setgid"), run_dir, log,
                                                   files=files)
                    values.append((time.perf_counter() - started) * 1000)
                    await process.wait()
        finally:
            jail._pivot_into = real  # type: ignore[assignment]
    return {mode: summary(values) for mode, values in times.items()}


async def run(repeats: int) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="fkd-jr-", dir="/var/tmp"))
    home.chmod(0o755)
    snapshot = home / "snapshots" / "tag"
    snapshot.mkdir(parents=True)
    layer, memory = snapshot / "disk.qcow2", snapshot / "memory"
    await create_overlay(IMAGE / "rootfs.ext4", layer, "raw")
    with open(memory, "wb") as f:
        f.truncate(512 << 20)
    memory.chmod(0o400)
    spec = BootSpec(IMAGE / "vmlinuz", IMAGE / "initrd.img", "console=ttyS0", 512, 1, "", "")
    vmm = QemuVmm(accelerator="tcg")
    real = jail._pivot_into
    times: dict[str, list[float]] = {"with_root": [], "without_root": []}
    build: list[float] = []

    def timed(plan: Any, mount_point: Path) -> None:
        started = time.perf_counter()
        real(plan, mount_point)
        build.append((time.perf_counter() - started) * 1000)

    n = 0
    try:
        spawn_ms = await spawn_only(home, list(vmm.machine.host_files(spec, [layer, IMAGE / "rootfs.ext4"], memory,
                                                                      share=False, boot=True)), repeats * 5)
        for _ in range(repeats):
            for mode in times:
                jail._pivot_into = timed if mode == "with_root" else (lambda plan, mount_point: None)  # type: ignore
                n += 1
                times[mode].append(1000 * await one_start(vmm, home, spec, layer, memory, n))
    finally:
        jail._pivot_into = real  # type: ignore[assignment]
        shutil.rmtree(home, ignore_errors=True)
    return {"start_ms": {mode: summary(values) for mode, values in times.items()}, "build_ms": summary(build),
            "spawn_ms": spawn_ms}


def plot(report: dict[str, Any]) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, label in ((axes[0], "start_ms", "jailed QEMU start to monitor answer (ms)"),
                           (axes[1], "spawn_ms", "the jail's part: spawn of `true` (ms)")):
        modes = list(report[key])
        ax.boxplot([report[key][m]["values"] for m in modes])
        ax.set_xticks(range(1, len(modes) + 1), [m.replace("_", " ") for m in modes])
        ax.set_ylabel(label)
    save(fig, RESULTS / "jail_root.png", f"A VMM's private root: start cost ({load_span(report)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    report: dict[str, Any] = {"repeats": args.repeats, "load_start": load_start, **asyncio.run(run(args.repeats))}
    report["load_end"] = os.getloadavg()[0]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "jail_root.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report)
    for mode in report["start_ms"]:
        print(f"{mode}: p50 {report['start_ms'][mode]['p50']:.1f} ms, p90 {report['start_ms'][mode]['p90']:.1f} ms")
    for mode, values in report["spawn_ms"].items():
        print(f"jail only ({mode}): p50 {values['p50']:.2f} ms, p90 {values['p90']:.2f} ms")
    print(f"building the root alone: p50 {report['build_ms']['p50']:.2f} ms; {load_span(report)}")


if __name__ == "__main__":
    main()
