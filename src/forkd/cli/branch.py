"""``forkd branch`` and the snapshot-chain commands (``snapshot-info``)."""

from __future__ import annotations

import click

from forkd.cli.main import console, daemon, print_json, reports_errors


@click.command("branch")
@click.argument("sandbox_id")
@click.option("--tag", required=True, help="name of the new snapshot")
@click.option("--mode", type=click.Choice(["full", "diff", "live"]), default="diff", show_default=True,
              help="full: whole memory; diff: only pages changed since the parent; live: copy RAM while it runs")
@click.option("--no-wait", is_flag=True, help="return as soon as the sandbox runs again (snapshot `writing`)")
@click.option("--json", "as_json", is_flag=True)
@reports_errors
def branch(sandbox_id: str, tag: str, mode: str, no_wait: bool, as_json: bool) -> None:
    """Save a running sandbox as a new snapshot; the sandbox keeps running, the snapshot is forkable."""
    info = daemon().branch(sandbox_id, tag, mode=mode, wait=not no_wait)
    if as_json:
        print_json(info)
    elif info["status"] == "ready":
        console.print(f"{tag}: ready ({info['memory_kind']} memory, paused {info['pause_ms']:.0f} ms, "
                      f"{info['total_seconds']:.1f} s) from {info['parent_tag']}")
    else:
        console.print(f"{tag}: {info['status']} (watch it with `forkd snapshot-info {tag}`)")


@click.command("snapshot-info")
@click.argument("tag")
@click.option("--json", "as_json", is_flag=True)
@reports_errors
def snapshot_info(tag: str, as_json: bool) -> None:
    """A snapshot's status, chain (depth, ancestors, dependents) and sizes."""
    info = daemon().snapshot(tag)
    if as_json:
        print_json(info)
        return
    console.print(f"{tag}: {info['status']}, depth {info['depth']}"
                  + (f", mode {info['mode']}" if "mode" in info else ""))
    console.print(f"  ancestors:  {' ← '.join(info['ancestors']) or '(none: a baked snapshot)'}")
    console.print(f"  dependents: {', '.join(info['all_dependents']) or '(none)'}")
    console.print(f"  size: {info['physical_bytes'] / 2**20:.1f} MiB own, "
                  f"{info['logical_bytes'] / 2**20:.1f} MiB with its chain")
    if "error" in info:
        console.print(f"  error: {info['error']}")


BRANCH_COMMANDS = (branch, snapshot_info)
