"""Pack and unpack time and size for a snapshot (the quickstart one by default), through the daemon.

Each repeat packs the snapshot to a file, unpacks it under a new tag (every digest verified, the
memory file written sparse), forks one child from the unpacked copy and checks it answers a numpy
eval, then removes the copy and the file. The snapshot is created like `forkd quickstart` does
when it is missing.

    .venv/bin/python bench/packs.py --tag quickstart --repeats 3

Writes bench/results/packs.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from forkd.config import paths_from_env
from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller, ForkdError
from forkd.store.usage import directory_usage

RESULTS = Path(__file__).with_name("results")


def one_round(controller: Controller, tag: str, work: Path) -> dict[str, Any]:
    pack_file = work / f"{tag}.tar.zst"
    copy = f"{tag}-bench-copy"
    started = time.monotonic()
    packed = controller.pack(tag, str(pack_file), force=True)
    pack_s = time.monotonic() - started
    started = time.monotonic()
    unpacked = controller.unpack(str(pack_file), tag=copy, force=True)
    unpack_s = time.monotonic() - started
    usage = directory_usage(Path(unpacked["path"]))
    fork = controller.fork(copy, 1)
    assert fork["errors"] == [], fork["errors"]
    child = fork["sandboxes"][0]["id"]
    answer = controller.eval(child, "float(numpy.ones(4).sum())")
    controller.kill(child)
    assert answer["value_json"] == 4.0, answer
    controller.remove_snapshot(copy)
    pack_file.unlink()
    return {"pack_s": pack_s, "unpack_s": unpack_s, "pack_bytes": packed["size"], "files_bytes": packed["bytes"],
            "unpacked_logical_bytes": usage["logical_bytes"], "unpacked_physical_bytes": usage["physical_bytes"],
            "fork_answered_s": fork["sandboxes"][0]["seconds_to_answer"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="quickstart")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default=str(paths_from_env().home / "packs"),
                        help="where the pack file is written: inside the daemon's packs_dir (default HOME/packs)")
    args = parser.parse_args()
    controller = ensure_daemon()
    Path(args.work_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        source = controller.snapshot(args.tag)
    except ForkdError:
        controller.build_image(name="default")
        source = controller.create_snapshot(args.tag)
    source_usage = next(s["disk"] for s in controller.snapshots() if s["tag"] == args.tag)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        rounds = [one_round(controller, args.tag, Path(work)) for _ in range(args.repeats)]
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    report = {"tag": args.tag, "memory_mib": source["boot"]["memory_mib"], "source_disk": source_usage,
              "rounds": rounds, "median": median, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "packs.json").write_text(json.dumps(report, indent=2) + "\n")
    mib = 2**20
    print(f"{args.tag}: files {median['files_bytes'] / mib:.0f} MiB (on disk {source_usage['physical_bytes'] / mib:.0f}"
          f" MiB) → pack {median['pack_bytes'] / mib:.1f} MiB in {median['pack_s']:.1f} s; unpack "
          f"{median['unpack_s']:.1f} s, {median['unpacked_physical_bytes'] / mib:.0f} MiB on disk; "
          f"forked child answered in {median['fork_answered_s']:.2f} s")


if __name__ == "__main__":
    main()
