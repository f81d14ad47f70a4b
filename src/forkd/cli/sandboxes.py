"""The sandbox commands: ``forkd fork``, ``forkd ps`` (``ls``), ``forkd pool``, ``forkd kill`` and the
``forkd sandbox ls|inspect|rm`` group."""

from __future__ import annotations

import sys
import time
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from forkd.cli.common import (
    EXIT_FAILED,
    console,
    daemon,
    describe_timings,
    err_console,
    alias,
    json_option,
    key_values,
    print_ids,
    print_json,
    print_rows,
    quiet_option,
    reports_errors,
)
from forkd.cli.isolation import describe_limits, describe_net, fork_options, isolation_options
from forkd.errors import Failure
from forkd.safetext import for_rich
from forkd.sdk.controller import ForkdError


@click.command("fork")
@click.option("--tag", required=True, help="snapshot to fork from")
@click.option("-n", "count", default=1, show_default=True, help="number of children")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True),
              help="seconds until the daemon kills each child (default: never)")
@click.option("--env", "-e", "envs", multiple=True, help="KEY=VALUE default env of every command (repeatable)")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE metadata kept with the sandbox (repeatable)")
@isolation_options
@json_option
@quiet_option
@click.option("-v", "--verbose", is_flag=True, help="show where each child's time went, stage by stage")
@click.option("--deadline", "deadline_s", type=click.FloatRange(min=0.1),
              help="wait at most this many seconds; children not answering by then are dropped")
@reports_errors
def fork(tag: str, count: int, timeout_s: float | None, envs: tuple[str, ...], labels: tuple[str, ...],
         as_json: bool, quiet: bool, verbose: bool, deadline_s: float | None, **isolation: Any) -> None:
    """Fork N children from a snapshot; one line per child as it answers, with its time to first answer
    (with -q only its id: `SB=$(forkd fork --tag py -q)`). Exits 1 if any child failed."""
    started = time.monotonic()
    options = dict(timeout_s=timeout_s, envs=key_values(envs, "--env"), metadata=key_values(labels, "--label"),
                   deadline_s=deadline_s, **fork_options(**isolation))
    if as_json:
        result = daemon().fork(tag, count, **options)
        print_json({**result, "total_seconds": time.monotonic() - started})
        if result["errors"]:
            sys.exit(1)
        return
    answered = failed = 0
    with Progress(TextColumn("forking"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True, disable=count < 2) as progress:
        bar = progress.add_task("children", total=count)
        for child in daemon().fork_iter(tag, count, **options):
            progress.advance(bar)
            if "sandbox" in child:
                answered += 1
                sandbox = child["sandbox"]
                if quiet:
                    print_ids([sandbox["id"]])
                    continue
                console.print(f"{sandbox['id']}  answered in {sandbox['seconds_to_answer'] * 1000:7.0f} ms")
                if verbose:
                    console.print("    " + describe_timings(child.get("timings") or {}))
            else:
                failed += 1
                err_console.print(f"[red]failed:[/red] {for_rich(Failure.from_answer(child.get('error')))}")
                if verbose:
                    err_console.print("    " + describe_timings(child.get("timings") or {}))
    if not quiet:
        err_console.print(f"{answered}/{count} children answering, {time.monotonic() - started:.2f} s in all")
    if failed:
        sys.exit(1)


def label_option(func: Any) -> Any:
    return click.option("--label", "-l", "label_filters", multiple=True, metavar="KEY=VALUE",
                        help="only sandboxes with this label (`fork --label`); repeat: all must match")(func)


def labelled(items: list[dict[str, Any]], label_filters: tuple[str, ...]) -> list[dict[str, Any]]:
    """The sandboxes whose labels (their metadata) hold every ``KEY=VALUE`` of ``label_filters``."""
    wanted = key_values(label_filters, "--label").items()
    return [item for item in items if wanted <= (item.get("metadata") or {}).items()]


@click.command("ls")
@json_option
@quiet_option
@click.option("--pool", "pools", is_flag=True, help="list the pools of ready VMMs instead, with their memory")
@label_option
@reports_errors
def ls(as_json: bool, quiet: bool, pools: bool, label_filters: tuple[str, ...]) -> None:
    """List running sandboxes (or, with --pool, the ready VMMs kept per snapshot)."""
    if pools:
        list_pools(as_json, quiet)
        return
    items = labelled(daemon(start=False).sandboxes(), label_filters)
    if as_json:
        print_json(items)
    elif quiet:
        print_ids(item["id"] for item in items)
    else:
        print_rows((Column("id", no_wrap=True, min_width=15), "snapshot", "status", "vm", "pid", "net", "limits",
                    "answered in", "age"), map(_sandbox_row, items))


def _sandbox_row(item: dict[str, Any]) -> tuple[str, ...]:
    answered = item.get("seconds_to_answer")
    # vm: running, or idle_stopped (stopped for being idle: its next request continues it), with the
    # memory then paged out to swap
    vm = item.get("vm_state", "running")
    if item.get("reclaimed_kib"):
        vm += f", {item['reclaimed_kib'] / 1024:.0f} MiB swapped"
    return (item["id"], item["snapshot_tag"], item["status"], vm, str(item["pid"]),
            describe_net(item),
            describe_limits(item), f"{answered * 1000:.0f} ms" if answered else "-",
            f"{time.time() - item['created_at']:.0f} s")


def list_pools(as_json: bool, quiet: bool) -> None:
    items = daemon(start=False).pools()
    if as_json:
        print_json(items)
    elif quiet:
        print_ids(pool["tag"] for pool in items)
    else:
        print_rows((Column("snapshot", no_wrap=True), "size", "ready", "starting", "warm", "Private_Dirty", "PSS"),
                   ((pool["tag"], str(pool["size"]), str(pool["ready"]), str(pool["starting"]),
                     "yes" if pool.get("warm") else "no", f"{pool['memory']['private_dirty_kib'] / 1024:.1f} MiB",
                     f"{pool['memory']['pss_kib'] / 1024:.1f} MiB") for pool in items))


@click.command("pool")
@click.argument("tag")
@click.option("--size", type=click.IntRange(min=0), required=True,
              help="ready VMMs to keep for the snapshot (0: none)")
@json_option
@reports_errors
def pool(tag: str, size: int, as_json: bool) -> None:
    """Keep SIZE VMMs of a snapshot ready (warm by default: state loaded, a fork's first calls run,
    stopped), so a fork only continues and reseeds one."""
    state = daemon().set_pool_size(tag, size)
    if as_json:
        print_json(state)
        return
    console.print(f"pool of {state['tag']}: size {state['size']}, {state['ready']} ready, "
                  f"{state['starting']} starting (filled in the background; `forkd ls --pool`)")


@click.command("kill")
@click.argument("sandbox_ids", nargs=-1)
@click.option("--all", "kill_all", is_flag=True, help="kill every sandbox (with --label: every one labelled so)")
@label_option
@reports_errors
def kill(sandbox_ids: tuple[str, ...], kill_all: bool, label_filters: tuple[str, ...]) -> None:
    """Kill sandboxes and release their resources; goes on past one that fails (then exits 1)."""
    if bool(sandbox_ids) == (kill_all or bool(label_filters)):
        raise click.UsageError("name sandbox ids, or pass --all and/or --label KEY=VALUE")
    kill_all = kill_all or bool(label_filters)
    controller = daemon()
    targets = [s["id"] for s in labelled(controller.sandboxes(), label_filters)] if kill_all else list(sandbox_ids)
    failed = 0
    for sandbox_id in targets:
        try:
            controller.kill(sandbox_id)
        except ForkdError as exc:
            if kill_all and (exc.status == 404 or exc.code == "sandbox_ended"):
                continue  # it ended (timeout, another kill) between the listing and now: nothing left to do
            failed += 1
            err_console.print(f"[red]error:[/red] {sandbox_id}: {for_rich(exc.message)}")
            continue
        console.print(f"killed {sandbox_id}")
    if failed:
        sys.exit(EXIT_FAILED)


@click.command("inspect")
@click.argument("sandbox_id")
@json_option
@reports_errors
def inspect(sandbox_id: str, as_json: bool) -> None:
    """A sandbox's whole record as JSON (--json is accepted and changes nothing)."""
    print_json(daemon(start=False).sandbox(sandbox_id))


@click.group("sandbox")
def sandbox() -> None:
    """Running sandboxes: ls, inspect, rm (`forkd fork` makes them)."""


sandbox.add_command(ls)
sandbox.add_command(inspect)
sandbox.add_command(kill, "rm")

SANDBOX_COMMANDS = (fork, pool, kill, sandbox, alias(ls, "ps", hidden=False), alias(ls, "ls"))
