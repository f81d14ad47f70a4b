"""``forkd branch`` and the snapshot-chain verbs of ``forkd snapshot``: ``info``, ``compact``, ``diff``."""

from __future__ import annotations

import click

from forkd.cli.common import console, daemon, describe_timings, json_option, print_json, reports_errors
from forkd.safetext import for_rich


@click.command("branch")
@click.argument("sandbox_id")
@click.option("--tag", required=True, help="name of the new snapshot")
@click.option("--mode", type=click.Choice(["full", "diff", "live"]), default="diff", show_default=True,
              help="full: whole memory; diff: only pages changed since the parent; live: copy RAM while it runs")
@click.option("--no-wait", is_flag=True, help="return as soon as the sandbox runs again (snapshot `writing`)")
@json_option
@click.option("-v", "--verbose", is_flag=True, help="show how long each stage took")
@reports_errors
def branch(sandbox_id: str, tag: str, mode: str, no_wait: bool, as_json: bool, verbose: bool) -> None:
    """Save a running sandbox as a new snapshot; the sandbox keeps running, the snapshot is forkable."""
    info = daemon().branch(sandbox_id, tag, mode=mode, wait=not no_wait)
    if as_json:
        print_json(info)
    elif info["status"] == "ready":
        console.print(f"{tag}: ready ({info['memory_kind']} memory, paused {info['pause_ms']:.0f} ms, "
                      f"{info['total_seconds']:.1f} s) from {info['parent_tag']}")
        if verbose:
            console.print("    " + describe_timings(info.get("timings") or {}))
    else:
        console.print(f"{tag}: {info['status']} (watch it with `forkd snapshot info {tag}`)")


@click.command("info")
@click.argument("tag")
@json_option
@reports_errors
def snapshot_info(tag: str, as_json: bool) -> None:
    """A snapshot's status, chain (depth, ancestors, dependents) and sizes."""
    info = daemon(start=False).snapshot(tag)
    if as_json:
        print_json(info)
        return
    console.print(f"{tag}: {info['status']}, depth {info['depth']}"
                  + (f", mode {info['mode']}" if "mode" in info else ""))
    console.print(f"  ancestors:  {' ← '.join(info['ancestors']) or '(none: a baked snapshot)'}")
    console.print(f"  dependents: {', '.join(info['all_dependents']) or '(none)'}")
    console.print(f"  size: {info['own_bytes'] / 2**20:.1f} MiB own, {info['chain_bytes'] / 2**20:.1f} MiB with its "
                  f"chain; files {info['disk']['logical_bytes'] / 2**20:.0f} MiB logical, "
                  f"{info['disk']['physical_bytes'] / 2**20:.0f} MiB physical")
    if "error" in info:
        console.print(f"  error: {for_rich(info['error'])}")


@click.command("compact")
@click.option("--from", "from_tag", required=True, help="the top of the chain to flatten")
@click.option("--to", "to_tag", required=True, help="name of the standalone snapshot")
@json_option
@reports_errors
def snapshot_compact(from_tag: str, to_tag: str, as_json: bool) -> None:
    """Flatten a snapshot chain into one standalone snapshot (the chain itself is kept)."""
    info = daemon().compact(from_tag, to_tag)
    if as_json:
        print_json(info)
        return
    console.print(f"{to_tag}: ready, standalone copy of {' ← '.join(info['compacted_chain'])} "
                  f"in {info['compact_seconds']:.1f} s")


@click.command("diff")
@click.option("--from", "base_tag", required=True, help="snapshot to start from")
@click.option("--tag", required=True, help="name of the new diff snapshot")
@click.option("--exec", "cmd", required=True, help="shell command whose changes the snapshot keeps")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, help="seconds the command may run")
@json_option
@reports_errors
def snapshot_diff(base_tag: str, tag: str, cmd: str, timeout_s: float, as_json: bool) -> None:
    """Fork a child of --from, run --exec in it, save what it changed as a diff layer, kill the child."""
    info = daemon().snapshot_diff(base_tag, tag, cmd, timeout_s=timeout_s)
    if as_json:
        print_json(info)
        return
    console.print(f"{tag}: ready, {info['changed_pages']} pages over {base_tag} "
                  f"({info['sizes']['memory.layer'] / 2**20:.1f} MiB layer)")


BRANCH_COMMANDS = (branch,)
SNAPSHOT_VERBS = (snapshot_info, snapshot_compact, snapshot_diff)
