"""How often a multi-vCPU guest's kernel oopses at boot under TCG, per TCG threading variant, and what
each variant costs (boot time; a CPU workload on every vCPU at once).

Boots guests from an image (the default one unless ``--image``), ``--parallel`` at a time, through
forkd's own QEMU command line (``QemuMachine.argv``, no daemon, no jail), variants interleaved, and
waits for the guest agent to answer. A boot fails when the console shows a kernel oops/BUG/panic or
the VMM exits before the agent answers. With ``--workload`` each guest that answered then runs
``--vcpus`` busy processes for a fixed amount of work each and reports the wall time.

Variants: ``auto`` (what forkd chooses now: ``accel.tcg_accel``), ``multi`` (``thread=multi``: one
host thread per vCPU), ``single`` (``thread=single``: all vCPUs on one host thread, round robin);
``+arg=WORD`` appends a guest kernel argument (``multi+arg=nohz=off``).

    flock /tmp/forkd-vm.lock .venv/bin/python bench/mttcg_boot.py --boots 20 --parallel 4 multi single

Writes bench/results/mttcg_boot.json and .png (``--out`` names another JSON, the PNG goes next to it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from figures import load_span, plt, save  # bench/figures.py, next to this script

from forkd.config import paths_from_env
from forkd.guest import protocol
from forkd.runtime.agent_client import AgentError, connect_when_answering
from forkd.runtime.snapshots import BASE_CMDLINE
from forkd.vmm.base import CONSOLE_LOG, BootSpec, VmmError
from forkd.vmm.qemu_disk import QemuDisk
from forkd.vmm.qemu_machine import QEMU_BINARY, QemuMachine, cpu_model, kill

RESULTS = Path(__file__).with_name("results")
OOPS = re.compile(r"Oops|BUG: |Kernel panic|general protection fault|invalid opcode")
#: Each process does the same fixed amount of pure-Python work; the wall time of all of them together
#: says whether the vCPUs ran in parallel.
WORKLOAD = ("for i in $(seq {n}); do python3 -c 'x=0\nfor i in range(3_000_000): x+=i' & done; wait")


def accel_for(variant: str, tb_size: int) -> str | None:
    """The ``-accel`` value a variant forces; None keeps what forkd's command line says."""
    threading = variant.split("+")[0]
    return None if threading == "auto" else f"tcg,tb-size={tb_size},thread={threading}"


async def one_boot(variant: str, index: int, image: Path, scratch: Path, vcpus: int, memory_mib: int,
                   timeout_s: float, workload: bool) -> dict[str, Any]:
    args = [p.split("=", 1)[1] for p in variant.split("+")[1:] if p.startswith("arg=")]
    manifest = json.loads((image / "manifest.json").read_text())
    spec = BootSpec(kernel=image / "vmlinuz", initrd=image / "initrd.img",
                    cmdline=" ".join([BASE_CMDLINE, "forkd.hostname=bench", *args]), memory_mib=memory_mib,
                    vcpus=vcpus, kernel_sha256=manifest["kernel_sha256"], agent_version=manifest["agent_version"])
    run_dir = scratch / f"{variant.split('+')[0]}-{index}-{os.urandom(3).hex()}"
    run_dir.mkdir()
    machine = QemuMachine(QEMU_BINARY, "tcg", cpu_model("tcg"), jail=None)
    disk = run_dir / "root.qcow2"
    await QemuDisk().new_root(image / "rootfs.ext4", disk)
    argv = [*machine.argv(spec, run_dir, disk, run_dir / "memory", share=True), "-S"]
    if (forced := accel_for(variant, machine.tb_size_mib)) is not None:
        argv[argv.index("-accel") + 1] = forced
    result: dict[str, Any] = {"variant": variant, "index": index, "accel": argv[argv.index("-accel") + 1]}
    started = time.monotonic()
    try:
        vm = await machine.start(f"b{index}", argv, run_dir, disk, setup=lambda qmp: qmp.execute("cont"))
    except VmmError as exc:
        return {**result, "ok": False, "error": str(exc)[:400]}
    try:
        agent, _ = await connect_when_answering(vm, timeout_s)
        result["answered_s"] = round(time.monotonic() - started, 2)
        try:
            if workload:
                began = time.monotonic()
                done = await agent.call(protocol.OP_EXEC, {"shell": WORKLOAD.format(n=vcpus)}, timeout=600)
                result["workload_s"] = round(time.monotonic() - began, 2)
                result["workload_exit"] = done.get("exit_code")
        finally:
            await agent.close()
    except (AgentError, VmmError, OSError, TimeoutError) as exc:  # the VMM died (an oops with panic=-1) or the agent never answered
        result["error"] = str(exc)[-600:]
    finally:
        await kill(vm)
    console = (run_dir / CONSOLE_LOG).read_text(errors="replace")
    oopses = [line.strip() for line in console.splitlines() if OOPS.search(line)]
    result["oops"] = oopses[:4]
    result["rip"] = next((line.strip() for line in console.splitlines() if "RIP:" in line), None)
    result["ok"] = "error" not in result and not oopses
    if not result["ok"]:
        kept = RESULTS / "mttcg_consoles"
        kept.mkdir(parents=True, exist_ok=True)
        shutil.copy(run_dir / CONSOLE_LOG, kept / f"{variant.replace('/', '_')}-{index}.log")
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        answered = [r["answered_s"] for r in mine if "answered_s" in r]
        work = [r["workload_s"] for r in mine if "workload_s" in r]
        out[variant] = {"boots": len(mine), "failed": sum(not r["ok"] for r in mine),
                        "oopsed": sum(bool(r["oops"]) for r in mine),
                        "answered_s_p50": statistics.median(answered) if answered else None,
                        "workload_s_p50": statistics.median(work) if work else None}
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--boots", type=int, default=20, help="boots per variant")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--vcpus", type=int, default=2)
    parser.add_argument("--memory-mib", type=int, default=1024)
    parser.add_argument("--image", default="default")
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--workload", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "mttcg_boot.json"))
    options = parser.parse_args()
    image = paths_from_env().images / options.image
    order = [(variant, i) for i in range(options.boots) for variant in options.variants]  # interleaved
    runs: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mttcg-", dir="/var/tmp") as scratch:
        for at in range(0, len(order), options.parallel):
            batch = order[at:at + options.parallel]
            runs += await asyncio.gather(*(one_boot(v, i, image, Path(scratch), options.vcpus, options.memory_mib,
                                                    options.timeout, options.workload) for v, i in batch))
            for r in runs[-len(batch):]:
                print(json.dumps({k: r.get(k) for k in ("variant", "index", "ok", "answered_s", "workload_s",
                                                        "oops", "rip", "error")}), flush=True)
    report = {"load_start": load_before[0], "load_end": os.getloadavg()[0], "options": vars(options),
              "summary": summarise(runs), "runs": runs}
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(report, indent=1))
    draw(report, Path(options.out).with_suffix(".png"))
    print(json.dumps(report["summary"], indent=1))


def draw(report: dict[str, Any], path: Path) -> None:
    summary = report["summary"]
    names = list(summary)
    fig, (fails, times) = plt.subplots(1, 2, figsize=(10, 4))
    fails.bar(names, [100 * s["failed"] / s["boots"] for s in summary.values()])
    for at, s in enumerate(summary.values()):
        fails.annotate(f"{s['failed']}/{s['boots']}", (at, 0), ha="center", va="bottom")
    fails.set_ylim(0, max(5.0, *(100 * s["failed"] / s["boots"] + 1 for s in summary.values())))
    fails.set_ylabel("boots that failed (%)")
    for offset, key, label in ((-0.2, "answered_s_p50", "boot to agent"), (0.2, "workload_s_p50", "CPU workload")):
        times.bar([at + offset for at in range(len(names))], [s[key] or 0 for s in summary.values()], 0.4, label=label)
    times.set_xticks(range(len(names)), names)
    times.set_ylabel("seconds (median)")
    times.legend()
    save(fig, path, f"{report['options']['vcpus']}-vCPU guests under TCG ({load_span(report)})")


if __name__ == "__main__":
    asyncio.run(main())
