"""What the E2B-shaped SDK costs over the bare REST client, side by side in one run.

Each operation runs through ``forkd.Sandbox`` and through ``Controller`` against the same live
child, interleaved, so machine noise hits both alike; the figures are medians and p90s and the
SDK/REST ratio of the medians. Sandbox creation is timed until the child answered its reseed (the
daemon's spawn point), as the fork API reports it.

    .venv/bin/python bench/sdk.py --tag quickstart --repeats 20

Writes bench/results/sdk.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from figures import plt, save  # bench/figures.py, next to this script

from forkd import Sandbox
from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller

RESULTS = Path(__file__).with_name("results")
BIG = 16 << 20


def timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(statistics.median(ordered) * 1000, 2),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2), "n": len(ordered)}


def operations(sandbox: Sandbox, api: Controller) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Name → (through the SDK, through the bare REST client), each doing the same work."""
    sid = sandbox.sandbox_id
    payload = os.urandom(BIG)
    return {
        "commands.run('true')": (lambda: sandbox.commands.run("true"), lambda: api.exec(sid, "true")),
        "run_code('1 + 1')": (lambda: sandbox.run_code("1 + 1"), lambda: api.run_code(sid, "1 + 1")),
        "eval('1')": (lambda: sandbox.eval("1"), lambda: api.eval(sid, "1")),
        "files.write 16 MiB": (lambda: sandbox.files.write("/tmp/b", payload),
                               lambda: api.write_file(sid, "/tmp/b", payload)),
        "files.read 16 MiB": (lambda: sandbox.files.read("/tmp/b", format="bytes"),
                              lambda: api.read_file(sid, "/tmp/b")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="quickstart")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--creates", type=int, default=5)
    args = parser.parse_args()
    api = ensure_daemon()
    os.environ.setdefault("FORKD_URL", api.url)

    creates = []
    for _ in range(args.creates):
        with Sandbox.create(template=args.tag, timeout=600) as sandbox:
            creates.append(api.sandbox(sandbox.sandbox_id)["seconds_to_answer"])

    figures: dict[str, Any] = {}
    with Sandbox.create(template=args.tag, timeout=3600) as sandbox:
        for name, (through_sdk, through_rest) in operations(sandbox, api).items():
            repeats = max(3, args.repeats // 4) if "MiB" in name else args.repeats
            sdk, rest = [], []
            for _ in range(repeats):  # interleaved: noise lands on both
                sdk.append(timed(through_sdk))
                rest.append(timed(through_rest))
            figures[name] = {"sdk": summary(sdk), "rest": summary(rest),
                             "ratio_p50": round(statistics.median(sdk) / statistics.median(rest), 3)}
            print(f"{name:24s} sdk {figures[name]['sdk']['p50_ms']:8.1f} ms  rest {figures[name]['rest']['p50_ms']:8.1f} ms"
                  f"  ratio {figures[name]['ratio_p50']:.2f}")
    report = {"tag": args.tag, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg(),
              "create_to_answer": summary(creates), "operations": figures}
    print("Sandbox.create → child answered:", report["create_to_answer"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sdk.json").write_text(json.dumps(report, indent=2) + "\n")

    names = list(figures)
    positions = range(len(names))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([p - 0.2 for p in positions], [figures[n]["sdk"]["p50_ms"] for n in names], width=0.4, label="Sandbox SDK")
    ax.bar([p + 0.2 for p in positions], [figures[n]["rest"]["p50_ms"] for n in names], width=0.4,
           label="Controller (REST)")
    ax.set_xticks(list(positions), names, rotation=15, fontsize=8)
    ax.set_ylabel("median latency (ms)")
    ax.set_yscale("log")
    ax.set_title("forkd SDK vs bare REST client, same child, interleaved (TCG guest)")
    ax.legend()
    save(fig, RESULTS / "sdk.png", dpi=120)


if __name__ == "__main__":
    main()
