"""Shell completion of what the daemon holds: running sandbox ids, ready snapshot tags, workspace and image names.

Click completes commands and options by itself (docs/cli.md, "Shell completion"); these add the values. Each
asks the daemon once, briefly, and never starts one: no daemon, a slow one or an error completes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import click
from click.shell_completion import CompletionItem

from forkd.sdk.controller import Controller, ForkdError

COMPLETION_TIMEOUT_S = 2.0

Lister = Callable[[Controller], Iterable[str]]


def _sandbox_ids(controller: Controller) -> Iterable[str]:
    return (s["id"] for s in controller.sandboxes() if s.get("status") == "running")


def _snapshot_tags(controller: Controller) -> Iterable[str]:
    return (s["tag"] for s in controller.snapshots() if s.get("status") == "ready")


def _workspace_names(controller: Controller) -> Iterable[str]:
    return (w["name"] for w in controller.workspaces())


def _image_names(controller: Controller) -> Iterable[str]:
    return (i["name"] for i in controller.images())


def completer(lister: Lister) -> Callable[[click.Context, click.Parameter, str], list[CompletionItem]]:
    def complete(_ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        try:
            with Controller(timeout=COMPLETION_TIMEOUT_S) as controller:
                names = sorted(lister(controller))
        except (ForkdError, OSError):
            return []
        return [CompletionItem(name) for name in names if name.startswith(incomplete)]
    return complete


#: (command path below `forkd`, parameter name) → what completes it; names that are new (a tag being
#: created) are left alone. Aliases share their command's parameters, so they complete the same.
COMPLETED: dict[tuple[str, str], Lister] = {
    **{(command, "tag"): _snapshot_tags for command in ("fork", "pool", "pack", "push", "snapshot rm",
                                                        "snapshot info", "workspace create")},
    ("snapshot compact", "from_tag"): _snapshot_tags, ("snapshot diff", "base_tag"): _snapshot_tags,
    **{(command, "name"): _workspace_names for command in ("workspace suspend", "workspace resume", "workspace rm")},
    ("image rm", "name"): _image_names,
}
SANDBOX_PARAMS = ("sandbox_id", "sandbox_ids")


def attach(group: click.Group) -> None:
    """Give every sandbox-id parameter, and the tags and names in ``COMPLETED``, their completion."""
    def walk(command: click.Command, path: tuple[str, ...]) -> None:
        for param in command.params:
            lister = _sandbox_ids if param.name in SANDBOX_PARAMS else COMPLETED.get((" ".join(path), param.name or ""))
            if lister is not None:
                param._custom_shell_complete = completer(lister)  # what Click's shell_complete= sets
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, (*path, name))
    walk(group, ())
