"""``forkd workspace``: named long-lived sandboxes that can be suspended to disk and resumed."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from forkd.cli.common import console, daemon, print_json, reports_errors


def _line(info: dict[str, Any]) -> str:
    where = info["sandbox_id"] if info["state"] == "running" else info["snapshot_tag"]
    return f"{info['name']}: {info['state']} ({where})"


@click.group("workspace")
def workspace() -> None:
    """Named sandboxes that live across sessions: suspend frees their memory, resume brings them back."""


@workspace.command("create")
@click.argument("name")
@click.option("--tag", required=True, help="snapshot to start from")
@reports_errors
def create(name: str, tag: str) -> None:
    """Start a workspace: a sandbox forked from TAG, kept under NAME."""
    console.print(_line(daemon().create_workspace(name, tag)))


@workspace.command("ls")
@click.option("--json", "as_json", is_flag=True)
@reports_errors
def ls(as_json: bool) -> None:
    """Workspaces: running (with their sandbox), suspended (with their snapshot) or lost."""
    items = daemon().workspaces()
    if as_json:
        print_json(items)
        return
    table = Table("name", "state", "sandbox", "snapshot", "suspends")
    for item in items:
        table.add_row(item["name"], item["state"], item["sandbox_id"] or "-", item["snapshot_tag"],
                      str(len(item["suspends"])))
    console.print(table)


@workspace.command("suspend")
@click.argument("name")
@reports_errors
def suspend(name: str) -> None:
    """Save the workspace (a diff BRANCH) and stop its sandbox."""
    console.print(_line(daemon().suspend_workspace(name)))


@workspace.command("resume")
@click.argument("name")
@reports_errors
def resume(name: str) -> None:
    """Start the workspace again where it was suspended."""
    console.print(_line(daemon().resume_workspace(name)))


@workspace.command("rm")
@click.argument("name")
@reports_errors
def rm(name: str) -> None:
    """Stop the workspace and remove its saved layers."""
    removed = daemon().remove_workspace(name)
    console.print(f"removed workspace {name}" + (f" and snapshots {', '.join(removed)}" if removed else ""))
