"""``forkd pack / unpack / pull / push / index``: moving snapshots between hosts as verified packs.

Paths are resolved here, then handed to the daemon, which reads and writes them on its own host
(the same host unless ``FORKD_URL`` names a remote daemon).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from forkd.cli.common import console, daemon, json_option, print_json, progress_display, reports_errors


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _is_url(text: str) -> bool:
    return text.startswith(("http://", "https://", "file://"))


def _report_unpacked(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(result)
        return
    reused = f", reusing {', '.join(result['reused'])}" if result.get("reused") else ""
    console.print(f"snapshot [bold]{result['tag']}[/bold] ready: unpacked {', '.join(result['unpacked'])}{reused} "
                  f"in {result['seconds']:.1f} s; fork it with `forkd fork --tag {result['tag']}`")


@click.command("pack")
@click.option("--tag", required=True, help="snapshot to pack (its ancestors come along)")
@click.option("-o", "--output", required=True,
              help="pack file to write, in the daemon's packs_dir (default $FORKD_HOME/packs)")
@click.option("--force", is_flag=True, help="overwrite the output file")
@json_option
@reports_errors
def pack(tag: str, output: str, force: bool, as_json: bool) -> None:
    """Bundle a snapshot, its chain and its disk into one verified .tar.zst file."""
    with progress_display() as on_progress:
        result = daemon().pack(tag, _absolute(output), force=force, on_progress=on_progress)
    if as_json:
        print_json(result)
        return
    console.print(f"packed {' → '.join(s['tag'] for s in result['chain'])} into {result['path']}: "
                  f"{result['size'] / 2**20:.1f} MiB ({result['bytes'] / 2**20:.0f} MiB of files) in "
                  f"{result['seconds']:.1f} s\nsha256 {result['sha256']}")


@click.command("unpack")
@click.argument("pack_file")
@click.option("--tag", help="register the snapshot under this tag instead of the packed one")
@click.option("--force", is_flag=True, help="replace a snapshot that has that tag")
@json_option
@reports_errors
def unpack(pack_file: str, tag: str | None, force: bool, as_json: bool) -> None:
    """Verify every file of a pack, then register its snapshots (all of them or none)."""
    with progress_display() as on_progress:
        unpacked = daemon().unpack(_absolute(pack_file), tag=tag, force=force, on_progress=on_progress)
    _report_unpacked(unpacked, as_json)


@click.command("pull")
@click.argument("source")
@click.option("--index", help="index file or URL; SOURCE is then the name of a pack in it (default $FORKD_INDEX)")
@click.option("--sha256", help="advertised SHA-256 of the pack file (with a URL SOURCE)")
@click.option("--tag", help="register the snapshot under this tag")
@click.option("--force", is_flag=True, help="replace a snapshot that has that tag")
@json_option
@reports_errors
def pull(source: str, index: str | None, sha256: str | None, tag: str | None, force: bool, as_json: bool) -> None:
    """Download a pack (URL or index entry), check its SHA-256, then unpack it."""
    if index is None and not _is_url(source) and not source.startswith(("/", ".")):
        index = os.environ.get("FORKD_INDEX") or None  # set but empty counts as unset
    if index is not None and not _is_url(index):
        index = _absolute(index)
    if index is None:
        if not _is_url(source) and not os.path.exists(source):
            raise click.UsageError(f"{source!r} is neither a URL nor a pack file; to pull a pack by name give "
                                   "--index FILE_OR_URL (or set FORKD_INDEX)")
        url = source if _is_url(source) else _absolute(source)
        with progress_display() as on_progress:
            result = daemon().pull(url, sha256=sha256, tag=tag, force=force, on_progress=on_progress)
    else:
        if sha256:
            raise click.UsageError("--sha256 is for a URL; an index advertises the digest of each pack")
        with progress_display() as on_progress:
            result = daemon().pull(index=index, name=source, tag=tag, force=force, on_progress=on_progress)
    _report_unpacked(result, as_json)


@click.command("push")
@click.option("--tag", required=True, help="snapshot to pack and upload")
@click.argument("url")
@json_option
@reports_errors
def push(tag: str, url: str, as_json: bool) -> None:
    """Pack a snapshot and upload it with one HTTP PUT (e.g. to a presigned URL)."""
    with progress_display() as on_progress:
        result = daemon().push(tag, url, on_progress=on_progress)
    if as_json:
        print_json(result)
        return
    console.print(f"pushed {tag} to {result['url']}: "
                  f"{result['size'] / 2**20:.1f} MiB\nsha256 {result['sha256']}")


@click.group("index")
def index() -> None:
    """Pack indexes ("hubs"): JSON files listing packs others can `forkd pull --index`."""


@index.command("add")
@click.argument("index_file", type=click.Path(dir_okay=False))
@click.argument("pack_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", required=True, help="name users pull the pack by")
@click.option("--url", required=True, help="where the pack will be downloaded from (may be relative to the index)")
@click.option("--description", default="")
@json_option
def index_add(index_file: str, pack_file: str, name: str, url: str, description: str, as_json: bool) -> None:
    """Add PACK_FILE to INDEX_FILE (created if missing) with its size, SHA-256 and machine identity."""
    from forkd.packs.format import PackError
    from forkd.packs.index import add_to_index
    try:
        entry = add_to_index(Path(index_file), Path(pack_file), name, url, description)
    except (PackError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        print_json(entry.model_dump(mode="json"))
        return
    console.print(f"{index_file}: {entry.name} → {entry.url} ({entry.size / 2**20:.1f} MiB, tag {entry.tag})")


PACK_COMMANDS = (pack, unpack, pull, push, index)
