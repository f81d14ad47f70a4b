"""What every ``forkd`` command shares: the consoles, the daemon client, error and progress reporting,
and how answers are printed (a table on a terminal; plain tab-separated lines, JSON or ids for scripts).

Commands live in their own modules (main.py, branch.py, packs.py, workspaces.py) and import from
here, never from each other, so the command modules form no import circle.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

import click
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn, TransferSpeedColumn)
from rich.table import Column, Table

from forkd.config import ConfigFileError, paths_from_env
from forkd.safetext import for_rich, visible
from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import Controller, ForkdError

# soft_wrap: a long line reaches a pipe whole (Rich would break it at 80 columns there).
console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)
F = TypeVar("F", bound=Callable[..., Any])

#: Exit status of a command forkd could not answer (daemon unreachable, refused, unknown sandbox, ...).
EXIT_FAILED = 1
#: Where Debian and Ubuntu keep the CA certificates a machine's admin added (what `update-ca-certificates` reads).
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")


def fail(exc: ForkdError, as_json: bool, status: int = EXIT_FAILED) -> NoReturn:
    """Report ``exc`` on stderr (one line, or ``{"error": {...}}`` under --json) and exit with ``status``."""
    if as_json:
        error = {"code": exc.code, "message": exc.message, "status": exc.status, **exc.details}
        click.echo(json.dumps({"error": error}), err=True)
    else:
        err_console.print(f"[red]error:[/red] {for_rich(exc.message)}")
    sys.exit(status)


def reports_errors(func: F) -> F:
    """Turn daemon errors into one line on stderr (JSON under --json) and exit status 1, not a traceback."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ForkdError as exc:
            fail(exc, bool(kwargs.get("as_json")))
    return wrapper  # type: ignore[return-value]


def alias(command: click.Command, name: str, hidden: bool = True) -> click.Command:
    """``command`` under another name: an older spelling that keeps working, hidden from help unless told."""
    other = copy.copy(command)
    other.name, other.hidden = name, hidden
    return other


def json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="print the answer as JSON on stdout")(func)


def ca_cert_options(func: F) -> F:
    """``--ca-cert FILE`` (repeatable) and ``--host-ca-certs``, handed to the command as one list ``ca_certs`` of
    PEM texts: what an image build adds to the guest's trust store (e.g. a TLS-intercepting proxy's CA)."""
    @functools.wraps(func)
    def wrapper(*args: Any, ca_cert_files: tuple[TextIO, ...], host_ca_certs: bool, **kwargs: Any) -> Any:
        kwargs["ca_certs"] = [f.read() for f in ca_cert_files] + (read_host_ca_certs() if host_ca_certs else [])
        return func(*args, **kwargs)
    with_host = click.option("--host-ca-certs", is_flag=True, help=f"add the CA certificates this host trusts "
                             f"locally ({HOST_CA_DIR}/*.crt), e.g. a TLS proxy's")(wrapper)
    return click.option("--ca-cert", "ca_cert_files", multiple=True, type=click.File("r"),  # type: ignore[return-value]
                        help="PEM CA certificate to add to the guest's trust store (repeatable)")(with_host)


def quiet_option(func: F) -> F:
    return click.option("-q", "--quiet", is_flag=True, help="print only ids (or tags, names), one per line")(func)


def print_rows(columns: Sequence[str | Column], rows: Iterable[Sequence[object]]) -> None:
    """A table on a terminal; elsewhere one tab-separated line per row, no header and nothing cut (as ``gh`` does),
    so ``cut -f1`` and ``awk -F'\t'`` read it. Cells may hold guest text: it is shown escaped either way."""
    if console.is_terminal:
        table = Table(*columns)
        for row in rows:
            table.add_row(*(for_rich(cell) for cell in row))
        console.print(table)
        return
    for row in rows:
        click.echo("\t".join(visible(str(cell)).replace("\t", "\\t") for cell in row))


def print_ids(ids: Iterable[str]) -> None:
    """``-q``: one id (tag, name) per line and nothing else."""
    for item in ids:
        click.echo(visible(item))


def daemon(start: bool = True) -> Controller:
    """The local daemon's client (``FORKD_URL``'s, when set). ``start``: start this host's daemon when none
    answers; read-only commands (listings, ``info``, ``inspect``) pass False and report an unreachable daemon."""
    try:
        paths = paths_from_env()
    except ConfigFileError as exc:
        raise click.ClickException(str(exc)) from None
    return ensure_daemon(paths) if start else Controller()


def progress_printer(prefix: str = "") -> Callable[[str], None]:
    started = time.monotonic()
    return lambda line: err_console.print(f"[dim]{time.monotonic() - started:7.1f}s[/dim] {prefix}{for_rich(line)}")


@contextlib.contextmanager
def progress_display() -> Iterator[Callable[[str], None]]:
    """What a long daemon operation reports, on stderr: on a terminal a bar with bytes, speed and ETA while
    the daemon counts bytes (packs, pulls, pushes; a pulsing one with the elapsed time for steps it cannot
    count, such as an image build), each other line printed above it; elsewhere one timed line each."""
    if not err_console.is_terminal:
        yield progress_printer()
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        printer = progress_printer()
        task = bar.add_task("working", total=None)
        verb = ""

        def show(line: str) -> None:
            nonlocal task, verb
            done = getattr(line, "done_bytes", None)
            if done is None:
                printer(line)
                return
            if line.split(" ", 1)[0] != verb:  # a new phase (verified, then unpacked): a bar of its own
                verb = line.split(" ", 1)[0]
                bar.remove_task(task)
                task = bar.add_task(for_rich(verb), total=getattr(line, "total_bytes", None))
            bar.update(task, completed=done)
        yield show


def key_values(pairs: tuple[str, ...], option: str) -> dict[str, str]:
    """``KEY=VALUE`` options as a dict; a pair without ``=`` is a usage error, not silently dropped."""
    bad = [pair for pair in pairs if "=" not in pair or pair.startswith("=")]
    if bad:
        raise click.UsageError(f"{option} wants KEY=VALUE, got {bad[0]!r}")
    return dict(pair.split("=", 1) for pair in pairs)


def print_json(data: Any) -> None:
    """Coloured on a terminal; elsewhere plain indented JSON (what ``jq`` reads)."""
    if console.is_terminal:
        console.print_json(json.dumps(data))
    else:
        click.echo(json.dumps(data, indent=2))


def describe_timings(timings: dict[str, float]) -> str:
    """``stop 1.2 · disk_switched 0.4 · ... ms``: the stages of a spawn or a BRANCH in the order they ran."""
    stages = [f"{stage} {ms:.1f}" for stage, ms in timings.items() if stage != "total"]
    return " · ".join(stages) + " ms" if stages else "(no stage timings)"


def read_host_ca_certs() -> list[str]:
    """The CA certificates this machine added to its own trust store, sorted by path."""
    if not HOST_CA_DIR.is_dir():
        return []
    return [path.read_text() for path in sorted(HOST_CA_DIR.rglob("*.crt")) if path.is_file()]
