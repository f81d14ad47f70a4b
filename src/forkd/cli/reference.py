"""docs/cli-reference.md, generated from the commands themselves, so the reference cannot drift from the CLI.

``python -m forkd.cli.reference > docs/cli-reference.md`` refreshes it; a unit test fails when the copy in
the repository differs. Markdown is written here (not Click's help text, which wraps to the terminal) so the
output is the same on every machine. Hidden commands (older spellings kept working) are listed at the end.
"""

from __future__ import annotations

import click

from forkd.cli.main import cli

HEADER = """# `forkd` command reference

Generated from the commands by `python -m forkd.cli.reference > docs/cli-reference.md` (a unit test checks it
is current); how to use them in scripts is in [cli.md](cli.md). `-h`/`--help` after any command prints the same.
"""


def _walk(command: click.Command, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], click.Command]]:
    found = [(path, command)]
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            found += _walk(command.commands[name], (*path, name))
    return found


def _option_row(param: click.Parameter, ctx: click.Context) -> str | None:
    if not isinstance(param, click.Option) or param.hidden:
        return None
    names = ", ".join(f"`{name}`" for name in [*param.opts, *param.secondary_opts])
    if not param.is_flag and param.metavar is not None:
        names += f" `{param.metavar}`"
    elif not param.is_flag:
        names += f" `{param.make_metavar(ctx)}`"
    text = " ".join((param.help or "").split())
    default = param.default if param.show_default or isinstance(param.default, (int, float)) else None
    if default not in (None, False, ()) and not param.is_flag and not callable(default):
        text += f" (default: {default})"
    return f"| {_cell(names)} | {_cell(text)} |"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _section(path: tuple[str, ...], command: click.Command) -> str:
    ctx = click.Context(command, info_name=" ".join(path), help_option_names=["-h", "--help"])
    usage = " ".join(["forkd", *path[1:], *command.collect_usage_pieces(ctx)]) if len(path) > 1 else "forkd"
    lines = [f"## `{' '.join(['forkd', *path[1:]])}`", "", f"```\n{usage}\n```", ""]
    doc = (command.help or "").split("\f")[0].strip()
    if doc:
        lines += [click.unstyle(doc), ""]
    rows = [row for param in command.get_params(ctx) if (row := _option_row(param, ctx))]
    if rows:
        lines += ["| option | meaning |", "|---|---|", *rows, ""]
    if isinstance(command, click.Group):
        visible = [name for name in sorted(command.commands) if not command.commands[name].hidden]
        lines += ["Commands: " + ", ".join(f"`{name}`" for name in visible), ""]
    return "\n".join(lines)


def render() -> str:
    commands = _walk(cli, ("forkd",))
    shown = [(path, command) for path, command in commands if not command.hidden]
    hidden = [" ".join(["forkd", *path[1:]]) for path, command in commands if command.hidden]
    parts = [HEADER, *(_section(path, command) for path, command in shown)]
    if hidden:
        parts.append("## Older spellings\n\nStill accepted, hidden from help (docs/cli.md says what each is now): "
                     + ", ".join(f"`{name}`" for name in hidden) + ".\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
