"""The ``forkd`` command line: a front end over the REST API (it starts the local daemon if needed)."""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from forkd.cli.branch import BRANCH_COMMANDS
from forkd.cli.cluster import CLUSTER_COMMANDS
from forkd.cli.common import (
    console,
    daemon,
    describe_timings,
    err_console,
    key_values,
    print_json,
    progress_printer,
    reports_errors,
)
from forkd.cli.daemon import daemon_command
from forkd.cli.doctor import doctor
from forkd.cli.isolation import describe_limits, describe_net, fork_options, isolation_options
from forkd.cli.node_drain import attach as attach_node_commands
from forkd.cli.packs import PACK_COMMANDS
from forkd.cli.quickstart import quickstart
from forkd.cli.workspaces import workspace
from forkd.errors import Failure
from forkd.safetext import for_rich
from forkd.validation import SANDBOX_ID_PREFIX

CP_CHUNK_BYTES = 1 << 20


@click.group()
@click.version_option(package_name="forkd")
def cli() -> None:
    """Fork warm microVMs copy-on-write: a fresh, isolated Linux VM per task in milliseconds."""


# images ------------------------------------------------------------------------------------------

#: Where Debian and Ubuntu keep the CA certificates a machine's admin added (what `update-ca-certificates` reads).
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")


def read_host_ca_certs() -> list[str]:
    """The CA certificates this machine added to its own trust store, sorted by path."""
    if not HOST_CA_DIR.is_dir():
        return []
    return [path.read_text() for path in sorted(HOST_CA_DIR.rglob("*.crt")) if path.is_file()]


@cli.group()
def image() -> None:
    """Guest images: kernel, initramfs and root filesystem with the forkd agent."""


@image.command("build")
@click.option("--name", default="default", show_default=True)
@click.option("--package", "packages", multiple=True, help="extra Debian package (repeatable)")
@click.option("--mirror", help="Debian mirror URL (default: from this machine's apt sources)")
@click.option("--from-dir", "source_dir", type=click.Path(exists=True, file_okay=False), help="use this root tree")
@click.option("--from-oci", "source_oci", type=click.Path(exists=True, dir_okay=False),
              help="use an OCI image tarball (docker save or OCI layout)")
@click.option("--disk-size-mib", type=int)
@click.option("--ca-cert", "ca_cert_files", multiple=True, type=click.File("r"),
              help="PEM CA certificate to add to the guest's trust store (repeatable)")
@click.option("--host-ca-certs", is_flag=True,
              help=f"add the CA certificates this host trusts locally ({HOST_CA_DIR}/*.crt), e.g. a TLS proxy's")
@click.option("--force", is_flag=True, help="rebuild even if the cached image is current")
@reports_errors
def image_build(name: str, packages: tuple[str, ...], mirror: str | None, source_dir: str | None,
                source_oci: str | None, disk_size_mib: int | None, ca_cert_files: tuple[TextIO, ...],
                host_ca_certs: bool, force: bool) -> None:
    """Build (or reuse from cache) a guest image."""
    ca_certs = [f.read() for f in ca_cert_files] + (read_host_ca_certs() if host_ca_certs else [])
    spec: dict[str, Any] = {"name": name, "packages": list(packages), "force": force, "ca_certs": ca_certs}
    for key, value in (("mirror", mirror), ("source_dir", source_dir), ("source_oci", source_oci),
                       ("disk_size_mib", disk_size_mib)):
        if value is not None:
            spec[key] = value
    result = daemon().build_image(on_progress=progress_printer(), **spec)
    console.print(f"image [bold]{result['name']}[/bold] ready: kernel {result['kernel_version']}, "
                  f"{result['size_bytes'] / 2**20:.0f} MiB at {result['path']}")


@image.command("ls")
@reports_errors
def image_ls() -> None:
    """List guest images."""
    table = Table("name", "kernel", "agent", "size", "key")
    for item in daemon().images():
        table.add_row(item["name"], item["kernel_version"], item["agent_version"],
                      f"{item['size_bytes'] / 2**20:.0f} MiB", item["key"][:12])
    console.print(table)


@image.command("rm")
@click.argument("name")
@reports_errors
def image_rm(name: str) -> None:
    """Remove a guest image (snapshots made from it keep their own copy)."""
    daemon().remove_image(name)
    console.print(f"removed image {name}")


# snapshots ---------------------------------------------------------------------------------------

@cli.group()
def snapshot() -> None:
    """Snapshots: a booted, warmed, paused parent that children fork from."""


@snapshot.command("create")
@click.option("--tag", required=True)
@click.option("--image", "image_name", default="default", show_default=True)
@click.option("--memory-mib", default=1024, show_default=True)
@click.option("--vcpus", default=1, show_default=True)
@click.option("--warm", "warm_modules", multiple=True, help="Python module to import before saving "
              "(repeatable; default numpy)")
@click.option("--warm-code", help="Python run once in the warm interpreter after the imports (every context and "
              "warm command forks from what it leaves behind)")
@click.option("--warmup-cmd", help='shell command run before saving; saving waits for it to print {"ready": true}')
@reports_errors
def snapshot_create(tag: str, image_name: str, memory_mib: int, vcpus: int, warm_modules: tuple[str, ...],
                    warm_code: str | None, warmup_cmd: str | None) -> None:
    """Boot a parent, warm it and save it as TAG."""
    options: dict[str, Any] = {"image": image_name, "memory_mib": memory_mib, "vcpus": vcpus}
    if warm_modules:
        options["warm_modules"] = list(warm_modules)
    if warm_code:
        options["warm_code"] = warm_code
    if warmup_cmd:
        options["warmup_cmd"] = warmup_cmd
    result = daemon().create_snapshot(tag, on_progress=progress_printer(), **options)
    console.print(f"snapshot [bold]{result['tag']}[/bold] ready (parent booted in {result['boot_seconds']:.1f} s, "
                  f"saved in {result['save_seconds'] * 1000:.0f} ms)")


def _list_snapshots() -> None:
    table = Table("tag", "parent", "status", "image", "memory", "vcpus", "size", "on disk", "created")
    for item in daemon().snapshots():
        disk = item.get("disk", {})
        table.add_row(item["tag"], item.get("parent_tag") or "-", item["status"], item["image"],
                      f"{item['boot']['memory_mib']} MiB", str(item["boot"]["vcpus"]),
                      f"{disk.get('logical_bytes', 0) / 2**20:.0f} MiB", f"{disk.get('physical_bytes', 0) / 2**20:.0f} MiB",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(item["created_at"])))
    console.print(table)


@cli.command("snapshots")
@reports_errors
def snapshots() -> None:
    """List snapshots."""
    _list_snapshots()


@cli.command("images")
@reports_errors
def images() -> None:
    """List snapshots (the name the reference forkd uses; guest images are `forkd image ls`)."""
    _list_snapshots()


@cli.command("rmi")
@click.argument("tag")
@click.option("--cascade", is_flag=True, help="also remove the snapshots branched from it")
@click.option("--force", is_flag=True, help="remove it even if snapshots were branched from it (they stop working)")
@reports_errors
def rmi(tag: str, cascade: bool, force: bool) -> None:
    """Remove a snapshot (refused while sandboxes forked from it run, or snapshots depend on it)."""
    removed = daemon().remove_snapshot(tag, cascade=cascade, force=force)
    console.print(f"removed snapshot{'s' if len(removed) > 1 else ''} {', '.join(removed)}")


# sandboxes ---------------------------------------------------------------------------------------

@cli.command("fork")
@click.option("--tag", required=True, help="snapshot to fork from")
@click.option("-n", "count", default=1, show_default=True, help="number of children")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True),
              help="seconds until the daemon kills each child (default: never)")
@click.option("--env", "-e", "envs", multiple=True, help="KEY=VALUE default env of every command (repeatable)")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE metadata kept with the sandbox (repeatable)")
@isolation_options
@click.option("--json", "as_json", is_flag=True)
@click.option("-v", "--verbose", is_flag=True, help="show where each child's time went, stage by stage")
@click.option("--deadline", "deadline_s", type=click.FloatRange(min=0.1),
              help="wait at most this many seconds; children not answering by then are dropped")
@reports_errors
def fork(tag: str, count: int, timeout_s: float | None, envs: tuple[str, ...], labels: tuple[str, ...],
         as_json: bool, verbose: bool, deadline_s: float | None, **isolation: Any) -> None:
    """Fork N children from a snapshot; one line per child as it answers, with its time to first answer."""
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
                console.print(f"{sandbox['id']}  answered in {sandbox['seconds_to_answer'] * 1000:7.0f} ms")
                if verbose:
                    console.print("    " + describe_timings(child.get("timings") or {}))
            else:
                failed += 1
                err_console.print(f"[red]failed:[/red] {for_rich(Failure.from_answer(child.get('error')))}")
                if verbose:
                    err_console.print("    " + describe_timings(child.get("timings") or {}))
    console.print(f"{answered}/{count} children answering, {time.monotonic() - started:.2f} s in all")
    if failed:
        sys.exit(1)


@cli.command("ls")
@click.option("--json", "as_json", is_flag=True)
@click.option("--pool", "pools", is_flag=True, help="list the pools of ready VMMs instead, with their memory")
@reports_errors
def ls(as_json: bool, pools: bool) -> None:
    """List running sandboxes (or, with --pool, the ready VMMs kept per snapshot)."""
    if pools:
        list_pools(as_json)
        return
    items = daemon().sandboxes()
    if as_json:
        print_json(items)
        return
    table = Table(Column("id", no_wrap=True, min_width=15), "snapshot", "status", "pid", "net", "limits",
                  "answered in", "age")
    for item in items:
        answered = item.get("seconds_to_answer")
        table.add_row(item["id"], item["snapshot_tag"], item["status"], str(item["pid"]), describe_net(item),
                      describe_limits(item), f"{answered * 1000:.0f} ms" if answered else "-",
                      f"{time.time() - item['created_at']:.0f} s")
    console.print(table)


def list_pools(as_json: bool) -> None:
    items = daemon().pools()
    if as_json:
        print_json(items)
        return
    table = Table(Column("snapshot", no_wrap=True), "size", "ready", "starting", "warm", "Private_Dirty", "PSS")
    for pool in items:
        memory = pool["memory"]
        table.add_row(pool["tag"], str(pool["size"]), str(pool["ready"]), str(pool["starting"]),
                      "yes" if pool.get("warm") else "no",
                      f"{memory['private_dirty_kib'] / 1024:.1f} MiB", f"{memory['pss_kib'] / 1024:.1f} MiB")
    console.print(table)


@cli.command("pool")
@click.argument("tag")
@click.option("--size", type=click.IntRange(min=0), required=True,
              help="ready VMMs to keep for the snapshot (0: none)")
@reports_errors
def pool(tag: str, size: int) -> None:
    """Keep SIZE VMMs of a snapshot ready (warm by default: state loaded, a fork's first calls run,
    stopped), so a fork only continues and reseeds one."""
    state = daemon().set_pool_size(tag, size)
    console.print(f"pool of {state['tag']}: size {state['size']}, {state['ready']} ready, "
                  f"{state['starting']} starting (filled in the background; `forkd ls --pool`)")


@cli.command("kill")
@click.argument("sandbox_ids", nargs=-1)
@click.option("--all", "kill_all", is_flag=True, help="kill every sandbox")
@reports_errors
def kill(sandbox_ids: tuple[str, ...], kill_all: bool) -> None:
    """Kill sandboxes and release their resources."""
    controller = daemon()
    targets = [s["id"] for s in controller.sandboxes()] if kill_all else list(sandbox_ids)
    if not targets and not kill_all:
        raise click.UsageError("name sandbox ids or pass --all")
    for sandbox_id in targets:
        controller.kill(sandbox_id)
        console.print(f"killed {sandbox_id}")


@cli.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--shell", "-s", is_flag=True, help="run COMMAND as one /bin/sh -c string")
@click.option("--env", "-e", "envs", multiple=True, help="KEY=VALUE (repeatable)")
@click.option("--cwd")
@click.option("--timeout", default=60.0, show_default=True, help="seconds")
@click.option("--warm", is_flag=True, help="COMMAND is python3 ...: run it as a fork of the warm interpreter")
@reports_errors
def exec_command(sandbox_id: str, command: tuple[str, ...], shell: bool, envs: tuple[str, ...], cwd: str | None,
                 timeout: float, warm: bool) -> None:
    """Run a command in a sandbox, streaming its output; exits with the command's status."""
    env = key_values(envs, "--env")

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "stdout":
            sys.stdout.write(event["data"])
            sys.stdout.flush()
        elif event.get("event") == "stderr":
            sys.stderr.write(event["data"])
            sys.stderr.flush()

    result = daemon().exec(sandbox_id, " ".join(command) if shell else list(command), env=env, cwd=cwd,
                           timeout_s=timeout, on_event=on_event, warm=warm)
    if result.get("timed_out"):
        err_console.print(f"[red]timed out after {timeout} s[/red]")
    sys.exit(result.get("exit_code", 1))


@cli.command("eval")
@click.argument("sandbox_id")
@click.argument("expr")
@reports_errors
def eval_command(sandbox_id: str, expr: str) -> None:
    """Evaluate one Python expression in the sandbox's warm interpreter."""
    result = daemon().eval(sandbox_id, expr)
    _print_python_result(result)


@cli.command("run-code")
@click.argument("sandbox_id")
@click.argument("code", required=False)
@click.option("--context", default="default", show_default=True)
@reports_errors
def run_code(sandbox_id: str, code: str | None, context: str) -> None:
    """Run Python statements (CODE, or stdin) in a persistent context, like a notebook cell."""
    result = daemon().run_code(sandbox_id, code if code is not None else sys.stdin.read(), context=context)
    sys.stdout.write(result.get("stdout", ""))
    sys.stderr.write(result.get("stderr", ""))
    _print_python_result(result)


def _print_python_result(result: dict[str, Any]) -> None:
    error = result.get("error")
    if error:
        err_console.print(error.get("traceback") or f"{error['name']}: {error['value']}", markup=False)
        sys.exit(1)
    if result.get("value") is not None:
        console.print(result["value"], markup=False)


@cli.command("cp")
@click.argument("src")
@click.argument("dst")
@reports_errors
def cp(src: str, dst: str) -> None:
    """Copy a file into or out of a sandbox: `forkd cp local SB:/path` or `forkd cp SB:/path local`.

    Both ways stream: memory use does not grow with the file (a guest file can be as large as it likes).
    """
    controller = daemon()
    if ":" in src and src.startswith(SANDBOX_ID_PREFIX):
        sandbox_id, path = src.split(":", 1)
        chunks = controller.read_file_chunks(sandbox_id, path)
        first = next(chunks, b"")  # a missing file fails here, before dst is created
        with open(dst, "wb") if dst != "-" else contextlib.nullcontext(sys.stdout.buffer) as out:
            out.write(first)
            for chunk in chunks:
                out.write(chunk)
    elif ":" in dst and dst.startswith(SANDBOX_ID_PREFIX):
        sandbox_id, path = dst.split(":", 1)
        with open(src, "rb") if src != "-" else contextlib.nullcontext(sys.stdin.buffer) as f:
            controller.write_file(sandbox_id, path, iter(functools.partial(f.read, CP_CHUNK_BYTES), b""))
    else:
        raise click.UsageError("one side must be SANDBOX_ID:/path")


@cli.group()
def files() -> None:
    """Inspect and change files inside a sandbox."""


@files.command("ls")
@click.argument("sandbox_id")
@click.argument("path", default="/")
@reports_errors
def files_ls(sandbox_id: str, path: str) -> None:
    table = Table("name", "type", "size", "mode")
    for entry in daemon().list_files(sandbox_id, path):
        table.add_row(for_rich(entry["name"]), entry["type"], str(entry["size"]), oct(entry["mode"] & 0o7777))
    console.print(table)


@files.command("stat")
@click.argument("sandbox_id")
@click.argument("path")
@reports_errors
def files_stat(sandbox_id: str, path: str) -> None:
    print_json(daemon().stat(sandbox_id, path))


@files.command("rm")
@click.argument("sandbox_id")
@click.argument("path")
@click.option("-r", "--recursive", is_flag=True)
@reports_errors
def files_rm(sandbox_id: str, path: str, recursive: bool) -> None:
    daemon().remove_file(sandbox_id, path, recursive=recursive)


@files.command("mkdir")
@click.argument("sandbox_id")
@click.argument("path")
@reports_errors
def files_mkdir(sandbox_id: str, path: str) -> None:
    daemon().make_dir(sandbox_id, path)


cli.add_command(quickstart)
cli.add_command(daemon_command)
cli.add_command(doctor)
for _command in (*PACK_COMMANDS, *BRANCH_COMMANDS, *CLUSTER_COMMANDS, workspace):
    cli.add_command(_command)
attach_node_commands(cli)  # after the others: `forkd node` may be made by another module


def main() -> None:
    cli()
