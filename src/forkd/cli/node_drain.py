"""``forkd node drain`` / ``undrain``: take this node out of service without killing its work (a
Kubernetes preStop, a host's maintenance), and back.

They talk to the daemon ``FORKD_URL`` names (or this host's socket) and never start one: draining a
daemon that does not run means nothing. They go under ``forkd node`` whichever module makes that group.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from forkd.cli.common import console, print_json, reports_errors
from forkd.safetext import for_rich
from forkd.sdk.controller import Controller

LEFT_EXIT_STATUS = 3  # `drain --wait` ended with sandboxes still running (1 is an error)


@click.command("drain")
@click.option("--wait", "wait_s", type=click.FloatRange(0, 3600), default=0.0, show_default=True,
              help="seconds to wait for the node's sandboxes to end")
@click.option("--json", "as_json", is_flag=True)
@reports_errors
def drain(wait_s: float, as_json: bool) -> None:
    """Take no new forks on this node (they get 503 `draining`); its running sandboxes carry on.

    Exits 0 once none is left, 3 when some still run after --wait.
    """
    with Controller() as controller:
        state = controller.drain(wait_s)
    if as_json:
        print_json(state)
    else:
        console.print(_left(state, wait_s))
    if state["sandboxes"] or state["starting"]:
        sys.exit(LEFT_EXIT_STATUS)


@click.command("undrain")
@reports_errors
def undrain() -> None:
    """Take forks on this node again."""
    with Controller() as controller:
        controller.undrain()
    console.print("the node takes forks again")


def _left(state: dict[str, Any], wait_s: float) -> str:
    running, starting = state["sandboxes"], state["starting"]
    if not running and not starting:
        return "drain: no sandboxes left"
    after = f" after {wait_s:g} s" if wait_s else ""
    shown = ", ".join(running[:10]) + (", …" if len(running) > 10 else "")
    return for_rich(f"drain: {len(running)} sandboxes still running{after} ({shown}), {starting} starting")


NODE_COMMANDS = (drain, undrain)


def attach(cli: click.Group) -> None:
    """Put these commands under ``forkd node``, making that group unless another module already did."""
    group = cli.commands.get("node")
    if group is None:
        group = click.Group("node", help="This host's daemon as a node of a cluster.")
        cli.add_command(group)
    assert isinstance(group, click.Group)
    for command in NODE_COMMANDS:
        group.add_command(command)
