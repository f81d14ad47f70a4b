"""How much removing a multi-gigabyte snapshot delays the daemon's other work: eval round trips to
running children, measured before and while `rmi` deletes the snapshot's files.

A snapshot is created whose guest filled most of its RAM with non-zero bytes (so its memory file
holds that much real data); two children of a warm snapshot (the quickstart one by default) answer
evals in a loop; the big snapshot is removed while they do. The figures are the eval round trips
(median, p99, max) in a baseline window and during the removal, and how long the removal took.

    .venv/bin/python bench/store_removal.py --tag quickstart --big-mib 3072 --baseline-s 10

Writes bench/results/store_removal.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller, ForkdError

RESULTS = Path(__file__).with_name("results")
BIG_TAG = "bench-store-removal-big"


def fill_command(mib: int) -> str:
    """A warmup command that keeps ``mib`` MiB of non-zero bytes alive in the guest, then reports ready."""
    return (f"python3 -c \"import time; kept = b'\\x01' * ({mib} << 20); print('{{\\\"ready\\\": true}}', "
            "flush=True); time.sleep(86400)\"")


def eval_latencies(controller: Controller, children: list[str], stop: threading.Event) -> list[float]:
    """Round trips of evals to ``children`` in turn until ``stop`` is set."""
    samples = []
    i = 0
    while not stop.is_set():
        child = children[i % len(children)]
        started = time.monotonic()
        answer = controller.eval(child, f"{i} + 1")
        samples.append(time.monotonic() - started)
        assert answer["value"] == str(i + 1), answer
        i += 1
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    if not samples:  # the removal ended before the first eval did
        return {"n": 0, "median_s": 0.0, "p99_s": 0.0, "max_s": 0.0}
    ordered = sorted(samples)
    return {"n": len(ordered), "median_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], "max_s": ordered[-1]}


def measure(controller: Controller, children: list[str], seconds: float | None,
            during: threading.Thread | None = None) -> list[float]:
    stop = threading.Event()
    result: list[float] = []
    sampler = threading.Thread(target=lambda: result.extend(eval_latencies(controller, children, stop)))
    sampler.start()
    if during is not None:
        during.start()
        during.join()
    else:
        time.sleep(seconds or 0)
    stop.set()
    sampler.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="quickstart", help="warm snapshot the children are forked from")
    parser.add_argument("--big-mib", type=int, default=3072, help="RAM of the snapshot that is removed")
    parser.add_argument("--baseline-s", type=float, default=10.0)
    args = parser.parse_args()
    controller = ensure_daemon()
    try:
        controller.snapshot(args.tag)
    except ForkdError:
        controller.build_image(name="default")
        controller.create_snapshot(args.tag)
    controller.create_snapshot(BIG_TAG, memory_mib=args.big_mib, warm_modules=[],
                               warmup_cmd=fill_command(args.big_mib * 5 // 6))
    big_disk = next(s["disk"] for s in controller.snapshots() if s["tag"] == BIG_TAG)
    forked = controller.fork(args.tag, 2)
    assert forked["errors"] == [], forked["errors"]
    children = [s["id"] for s in forked["sandboxes"]]
    removal: dict[str, Any] = {}

    def remove() -> None:
        with Controller(url=controller.url) as other:
            started = time.monotonic()
            other.remove_snapshot(BIG_TAG)
            removal["seconds"] = time.monotonic() - started

    try:
        baseline = measure(controller, children, args.baseline_s)
        during = measure(controller, children, None, threading.Thread(target=remove))
    finally:
        for child in children:
            controller.kill(child)
    report = {"tag": args.tag, "big_mib": args.big_mib, "big_disk": big_disk, "removal_s": removal.get("seconds"),
              "baseline": summary(baseline), "during_removal": summary(during),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "store_removal.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"removed {big_disk['physical_bytes'] / 2**30:.1f} GiB in {report['removal_s']:.2f} s; eval round trip "
          f"median/p99/max {report['baseline']['median_s'] * 1000:.0f}/{report['baseline']['p99_s'] * 1000:.0f}/"
          f"{report['baseline']['max_s'] * 1000:.0f} ms before, {report['during_removal']['median_s'] * 1000:.0f}/"
          f"{report['during_removal']['p99_s'] * 1000:.0f}/{report['during_removal']['max_s'] * 1000:.0f} ms during")


if __name__ == "__main__":
    main()
