"""What every ``forkd`` command shares: the consoles, the daemon client, error and progress reporting.

Commands live in their own modules (main.py, branch.py, packs.py, workspaces.py) and import from
here, never from each other, so the command modules form no import circle.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console

from forkd.config import paths_from_env
from forkd.safetext import for_rich
from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller, ForkdError

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
F = TypeVar("F", bound=Callable[..., Any])


def reports_errors(func: F) -> F:
    """Turn daemon errors into one readable line and exit status 1, not a traceback."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ForkdError as exc:
            err_console.print(f"[red]error:[/red] {for_rich(exc.message)}")
            sys.exit(1)
    return wrapper  # type: ignore[return-value]


def daemon() -> Controller:
    return ensure_daemon(paths_from_env())


def progress_printer(prefix: str = "") -> Callable[[str], None]:
    started = time.monotonic()
    return lambda line: err_console.print(f"[dim]{time.monotonic() - started:7.1f}s[/dim] {prefix}{for_rich(line)}")


def key_values(pairs: tuple[str, ...], option: str) -> dict[str, str]:
    """``KEY=VALUE`` options as a dict; a pair without ``=`` is a usage error, not silently dropped."""
    bad = [pair for pair in pairs if "=" not in pair or pair.startswith("=")]
    if bad:
        raise click.UsageError(f"{option} wants KEY=VALUE, got {bad[0]!r}")
    return dict(pair.split("=", 1) for pair in pairs)


def print_json(data: Any) -> None:
    console.print_json(json.dumps(data))


def describe_timings(timings: dict[str, float]) -> str:
    """``stop 1.2 · disk_switched 0.4 · ... ms``: the stages of a spawn or a BRANCH in the order they ran."""
    stages = [f"{stage} {ms:.1f}" for stage, ms in timings.items() if stage != "total"]
    return " · ".join(stages) + " ms" if stages else "(no stage timings)"
