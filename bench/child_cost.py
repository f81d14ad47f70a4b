"""CPU and memory of one child under host-side variants, A/B side by side in one run.

Each round restores one child per variant, interleaved (A, B, C, A, B, C, ...), through the QEMU
backend directly (no daemon), from the same snapshot: reseed, a numpy eval, a shell command, then
reads what the child cost. Figures that load on a shared machine distorts least: Private_Dirty by
what holds it (TCG translation cache, guest RAM copied on write, QEMU heap, other), the VMM's CPU
time (utime + stime from /proc, not wall time) and the TCG translation-buffer flush count from
HMP ``info jit``, and the finer breakdown of ``vmm_memory.py`` (thread stacks, malloc arenas, ...).
Variants: ``tb16``, ``tb8``, ``tb32`` (TCG ``tb-size`` MiB; ``--tb`` for the others), an allocator
setting for QEMU's environment (``arena1``, ``arena2``: ``MALLOC_ARENA_MAX``; ``trim``: glibc
tunables that return freed memory at once), ``thp`` (QEMU may use transparent huge pages; without it
they are off, ``PR_SET_THP_DISABLE`` inherited, as the daemon runs its VMMs), ``nojail`` (QEMU as
root without the VMM jail, ``[confinement] enabled = false``), ``microvm`` (the snapshot
``--microvm-tag``: the same settings baked with ``--machine microvm``), or ``snapshot=TAG`` to compare
another snapshot (e.g. one baked with other guest settings); parts combine with ``+`` (``tb16+thp``).
With ``--settle S`` the memory is read a second time S seconds later (``later_mib``): a reading that
moves on its own shows work the idle guest still does.

    FORKD_HOME=... .venv/bin/python bench/child_cost.py --tag quickstart --rounds 5 tb16 tb8 tb32 arena1
    # q35 against microvm, same load: bake both, then A/B them
    forkd snapshot create --tag cq35 --memory-mib 1024 && forkd snapshot create --tag cq35-microvm --machine microvm
    FORKD_HOME=... .venv/bin/python bench/child_cost.py --tag cq35 --rounds 5 --settle 3 tb32 microvm

Writes bench/results/child_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from spawn import smaps_breakdown  # bench/spawn.py, next to this script
from vmm_memory import detailed

from forkd.config import paths_from_env
from forkd.guest import protocol
from forkd.runtime.agent_client import connect_when_answering
from forkd.store.files import DigestCache
from forkd.store.registry import Registry
from forkd.store.snapshots import SnapshotStore
from forkd.vmm.base import VmHandle, restore
from forkd.vmm.qemu import QemuVmm
from forkd.vmm.qemu_machine import monitor

RESULTS = Path(__file__).with_name("results")
TICKS = os.sysconf("SC_CLK_TCK")
PR_SET_THP_DISABLE = 41
#: What a variant puts into the environment QEMU inherits.
ENVIRONMENTS = {
    "arena1": {"MALLOC_ARENA_MAX": "1"},
    "arena2": {"MALLOC_ARENA_MAX": "2"},
    "trim": {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0:glibc.malloc.mmap_threshold=65536"},
}


def set_thp_disable(disabled: bool) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_THP_DISABLE, int(disabled), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE)")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def private_dirty(pid: int, memory_file: str) -> dict[str, float]:
    kinds = smaps_breakdown(pid, memory_file)
    return {**kinds, "total": round(sum(kinds.values()), 2)}


async def info_jit(vm: VmHandle) -> dict[str, int]:
    async with monitor(vm) as qmp:
        text = await qmp.execute("human-monitor-command", {"command-line": "info jit"})
    found = {}
    for key in ("TB flush count", "TB count", "TB invalidate count"):
        match = re.search(rf"{key}\s+(\d+)", str(text))
        if match:
            found[key.lower().replace(" ", "_")] = int(match.group(1))
    return found


async def one_child(variant: str, snapshots: SnapshotStore, args: argparse.Namespace, scratch: Path,
                    index: int) -> dict[str, Any]:
    parts = variant.split("+")
    tb_default = args.tb
    default_tag = (args.microvm_tag or f"{args.tag}-microvm") if "microvm" in parts else args.tag
    tag = next((p.split("=", 1)[1] for p in parts if p.startswith("snapshot=")), default_tag)
    tb = next((int(p[2:]) for p in parts if p.startswith("tb")), tb_default)
    env = {k: v for p in parts for k, v in ENVIRONMENTS.get(p, {}).items()}
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # inherited by the QEMU process started next
    _, saved, spec = await asyncio.to_thread(snapshots.open, tag)
    run_dir = scratch / f"c{index}"
    run_dir.mkdir()
    vmm = QemuVmm(tb_size_mib=tb, jail=None if "nojail" in parts else "default", huge_pages=True)
    started = time.monotonic()
    set_thp_disable("thp" not in parts)  # inherited by the QEMU process started next (and kept across its exec)
    try:
        vm = await restore(vmm, f"c{index}", saved, spec, run_dir)
    finally:
        set_thp_disable(False)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        agent, _ = await connect_when_answering(vm, 120, protocol.OP_RESEED, {
            "entropy_b64": protocol.b64encode(os.urandom(64)), "time_ns": time.time_ns(),
            "hostname": f"c{index}", "sandbox_id": f"c{index}"})
        answered = time.monotonic() - started
        try:
            await agent.call(protocol.OP_EVAL, {"expr": "float(numpy.random.rand(256, 256).sum())"}, timeout=120)
            await agent.call(protocol.OP_EXEC, {"shell": "true"}, timeout=120)
        finally:
            await agent.close()
        found = {"variant": variant, "machine": spec.machine, "answered_s": answered, "cpu_s": cpu_seconds(vm.pid),
                 "private_dirty_mib": private_dirty(vm.pid, str(saved.memory)), "jit": await info_jit(vm),
                 "detail_mib": detailed(vm.pid, str(saved.memory))}
        if args.settle:
            await asyncio.sleep(args.settle)
            found["later_mib"] = private_dirty(vm.pid, str(saved.memory))
            found["later_cpu_s"] = cpu_seconds(vm.pid)
        return found
    finally:
        await vmm.kill(vm)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        out[variant] = {
            "cpu_s_p50": med(r["cpu_s"] for r in mine),
            "answered_s_p50": med(r["answered_s"] for r in mine),
            "private_dirty_mib_p50": {k: med(r["private_dirty_mib"][k] for r in mine)
                                      for k in mine[0]["private_dirty_mib"]},
            "detail_mib_p50": {k: med(r["detail_mib"].get(k, 0) for r in mine) for k in mine[0]["detail_mib"]
                               if isinstance(mine[0]["detail_mib"][k], float)},
            "threads": mine[0]["detail_mib"]["threads"],
            "largest_other": mine[0]["detail_mib"]["largest_other"],
            "tb_flush_count_max": max(r["jit"].get("tb_flush_count", -1) for r in mine),
            "machine": mine[0]["machine"],
            **({"later_mib_p50": {k: med(r["later_mib"][k] for r in mine) for k in mine[0]["later_mib"]},
                "later_cpu_s_p50": med(r["later_cpu_s"] for r in mine)} if "later_mib" in mine[0] else {}),
            "n": len(mine),
        }
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    paths = paths_from_env()
    registry = Registry(paths.db)
    vmm = QemuVmm()
    snapshots = SnapshotStore(paths.snapshots, registry, DigestCache(), vmm.identity, vmm.disk)
    runs = []
    with tempfile.TemporaryDirectory(prefix="forkd-child-cost-", dir="/var/tmp") as scratch:
        index = 0
        for round_ in range(args.rounds):
            for variant in args.variants:
                runs.append(await one_child(variant, snapshots, args, Path(scratch), index))
                index += 1
                print(f"round {round_} {variant}: cpu {runs[-1]['cpu_s']:.2f} s, Private_Dirty "
                      f"{runs[-1]['private_dirty_mib']['total']:.1f} MiB, jit {runs[-1]['jit']}", flush=True)
    return {"tag": args.tag, "rounds": args.rounds, "summary": summarise(runs), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="quickstart")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="child_cost")
    parser.add_argument("--tb", type=int, default=32, help="tb-size (MiB) of the variants that do not set one")
    parser.add_argument("--microvm-tag", help="the snapshot of the microvm variant (default: TAG-microvm)")
    parser.add_argument("--settle", type=float, default=0.0, help="read memory again this many seconds later")
    parser.add_argument("variants", nargs="*", default=["tb16", "tb8", "tb32", "arena1"])
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    report = asyncio.run(main_async(args))
    report["load"] = [load_before, os.getloadavg()[0]]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({"load": report["load"], "summary": report["summary"]}, indent=2))


if __name__ == "__main__":
    main()
