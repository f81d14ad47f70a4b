"""``forkd workspace``: named long-lived sandboxes that can be suspended to disk and resumed."""

from __future__ import annotations

from typing import Any

import click

from forkd.cli.common import (
    console,
    daemon,
    json_option,
    print_ids,
    print_json,
    print_rows,
    quiet_option,
    reports_errors,
)


def _show(info: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(info)
        return
    where = info["sandbox_id"] if info["state"] == "running" else info["snapshot_tag"]
    console.print(f"{info['name']}: {info['state']} ({where})")


@click.group("workspace")
def workspace() -> None:
    """Named sandboxes that live across sessions: suspend frees their memory, resume brings them back."""


@workspace.command("create")
@click.argument("name")
@click.option("--tag", required=True, help="snapshot to start from")
@json_option
@reports_errors
def create(name: str, tag: str, as_json: bool) -> None:
    """Start a workspace: a sandbox forked from TAG, kept under NAME."""
    _show(daemon().create_workspace(name, tag), as_json)


@workspace.command("ls")
@json_option
@quiet_option
@reports_errors
def ls(as_json: bool, quiet: bool) -> None:
    """Workspaces: running (with their sandbox), suspended (with their snapshot) or lost."""
    items = daemon(start=False).workspaces()
    if as_json:
        print_json(items)
    elif quiet:
        print_ids(item["name"] for item in items)
    else:
        print_rows(("name", "state", "sandbox", "snapshot", "suspends"),
                   ((item["name"], item["state"], item["sandbox_id"] or "-", item["snapshot_tag"],
                     str(len(item["suspends"]))) for item in items))


@workspace.command("suspend")
@click.argument("name")
@json_option
@reports_errors
def suspend(name: str, as_json: bool) -> None:
    """Save the workspace (a diff BRANCH) and stop its sandbox."""
    _show(daemon().suspend_workspace(name), as_json)


@workspace.command("resume")
@click.argument("name")
@json_option
@reports_errors
def resume(name: str, as_json: bool) -> None:
    """Start the workspace again where it was suspended."""
    _show(daemon().resume_workspace(name), as_json)


@workspace.command("rm")
@click.argument("name")
@reports_errors
def rm(name: str) -> None:
    """Stop the workspace and remove its saved layers."""
    removed = daemon().remove_workspace(name)
    console.print(f"removed workspace {name}" + (f" and snapshots {', '.join(removed)}" if removed else ""))
