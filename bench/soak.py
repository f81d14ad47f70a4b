"""Soak: N concurrent clients spawn, exec, eval and kill sandboxes for a bounded time; zero errors expected.

Every client loops fork(1) → exec → eval → kill until the time is up (a cycle already started is
finished, so the run ends within one cycle of ``--seconds``). Afterwards the daemon must list no
sandbox and, for a local daemon, no VMM process or run directory may be left under FORKD_HOME.

    .venv/bin/python bench/soak.py --tag quickstart --clients 4 --seconds 180

Writes bench/results/soak.json; exits 1 if any operation failed or anything leaked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from forkd.config import paths_from_env
from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller, ForkdError
from forkd.vmm.process import processes_under

RESULTS = Path(__file__).with_name("results")


def client_loop(url: str, tag: str, until: float, index: int, out: dict[str, Any], lock: threading.Lock) -> None:
    """One client: its own connection, cycles until ``until``; every failure is recorded, none stops the run."""
    cycles, latencies, errors = 0, {"fork": [], "exec": [], "eval": [], "kill": []}, []
    with Controller(url=url) as client:
        while time.monotonic() < until:
            sandbox_id = None
            try:
                t0 = time.monotonic()
                forked = client.fork(tag, 1)
                if forked["errors"]:
                    raise ForkdError(500, "fork", "; ".join(forked["errors"]))
                sandbox_id = forked["sandboxes"][0]["id"]
                t1 = time.monotonic()
                ran = client.exec(sandbox_id, f"echo client-{index}-{cycles}", timeout_s=30)
                if ran["stdout"] != f"client-{index}-{cycles}\n" or ran["exit_code"] != 0:
                    raise ForkdError(500, "exec", f"unexpected exec result {ran}")
                t2 = time.monotonic()
                value = client.eval(sandbox_id, f"{cycles} * 2")["value_json"]
                if value != cycles * 2:
                    raise ForkdError(500, "eval", f"eval gave {value!r}")
                t3 = time.monotonic()
                client.kill(sandbox_id)
                sandbox_id = None
                t4 = time.monotonic()
                for name, took in (("fork", t1 - t0), ("exec", t2 - t1), ("eval", t3 - t2), ("kill", t4 - t3)):
                    latencies[name].append(took)
                cycles += 1
            except ForkdError as exc:
                errors.append(f"client {index}: {exc.code}: {exc.message}")
                if sandbox_id is not None:
                    try:
                        client.kill(sandbox_id)
                    except ForkdError as kill_exc:
                        errors.append(f"client {index}: kill after error: {kill_exc.message}")
    with lock:
        out["cycles"] += cycles
        out["errors"].extend(errors)
        for name, values in latencies.items():
            out["latencies"][name].extend(values)


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"median_ms": statistics.median(ordered) * 1000, "p95_ms": ordered[int(0.95 * (len(ordered) - 1))] * 1000,
            "max_ms": ordered[-1] * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", required=True, help="snapshot to fork from (must exist)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=180.0, help="stop starting cycles after this long")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args()
    if not 1 <= args.clients <= 64 or not 1 <= args.seconds <= 3600:
        parser.error("--clients must be 1..64 and --seconds 1..3600")
    paths = paths_from_env()
    controller = ensure_daemon(paths)
    controller.snapshot(args.tag)  # fails early with the daemon's message if it does not exist
    before = {s["id"] for s in controller.sandboxes()}
    out: dict[str, Any] = {"cycles": 0, "errors": [], "latencies": {k: [] for k in ("fork", "exec", "eval", "kill")}}
    lock = threading.Lock()
    started = time.monotonic()
    until = started + args.seconds
    threads = [threading.Thread(target=client_loop, args=(controller.url, args.tag, until, i, out, lock))
               for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    left = sorted({s["id"] for s in controller.sandboxes()} - before)
    local = controller.url.startswith("unix://")
    vmms = len({r.pid for r in processes_under(paths.sandboxes, "qemu-system-x86_64")}) if local else None
    run_dirs = sorted(p.name for p in paths.sandboxes.iterdir()) if local and paths.sandboxes.exists() else None
    version = controller.version()
    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tag": args.tag, "clients": args.clients, "seconds_requested": args.seconds, "seconds": round(elapsed, 1),
        "vmm": f"{version['vmm']} {version['vmm_version']}", "accelerator": version["accelerator"],
        "cycles": out["cycles"], "cycles_per_s": round(out["cycles"] / elapsed, 2),
        "errors": out["errors"], "error_count": len(out["errors"]),
        "latency": {name: summary(values) for name, values in out["latencies"].items()},
        "sandboxes_left": left, "vmm_processes_left": vmms,
        "run_dirs_left": [d for d in run_dirs if d not in before] if run_dirs is not None else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "errors"}, indent=2))
    for error in out["errors"][:20]:
        print(error, file=sys.stderr)
    leaked = bool(left) or bool(result["run_dirs_left"]) or (vmms is not None and vmms > len(before))
    return 1 if out["errors"] or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
