"""The ``forkd`` command line: a front end over the REST API (it starts the local daemon if needed)."""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import Any

import click

from forkd.cli.branch import BRANCH_COMMANDS, SNAPSHOT_VERBS
from forkd.cli.cluster import CLUSTER_COMMANDS
from forkd.cli.common import (
    EXIT_FAILED,
    alias,
    ca_cert_options,
    console,
    daemon,
    err_console,
    json_option,
    print_ids,
    print_json,
    print_rows,
    progress_display,
    quiet_option,
    reports_errors,
)
from forkd.cli.completion import attach as attach_completion
from forkd.cli.daemon import daemon_command
from forkd.cli.doctor import doctor
from forkd.cli.execute import exec_command, shell_command
from forkd.cli.node_drain import attach as attach_node_commands
from forkd.cli.packs import PACK_COMMANDS
from forkd.cli.quickstart import quickstart
from forkd.cli.sandboxes import SANDBOX_COMMANDS
from forkd.cli.templates import template
from forkd.cli.workspaces import workspace
from forkd.validation import SANDBOX_ID_PREFIX

CP_CHUNK_BYTES = 1 << 20


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="forkd")
def cli() -> None:
    """Fork warm microVMs copy-on-write: a fresh, isolated Linux VM per task in milliseconds."""


# images ------------------------------------------------------------------------------------------

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
@ca_cert_options
@click.option("--force", is_flag=True, help="rebuild even if the cached image is current")
@json_option
@reports_errors
def image_build(name: str, packages: tuple[str, ...], mirror: str | None, source_dir: str | None,
                source_oci: str | None, disk_size_mib: int | None, ca_certs: list[str], force: bool,
                as_json: bool) -> None:
    """Build (or reuse from cache) a guest image."""
    spec: dict[str, Any] = {"name": name, "packages": list(packages), "force": force, "ca_certs": ca_certs}
    for key, value in (("mirror", mirror), ("source_dir", source_dir), ("source_oci", source_oci),
                       ("disk_size_mib", disk_size_mib)):
        if value is not None:
            spec[key] = value
    with progress_display() as on_progress:
        result = daemon().build_image(on_progress=on_progress, **spec)
    if as_json:
        print_json(result)
        return
    console.print(f"image [bold]{result['name']}[/bold] ready: kernel {result['kernel_version']}, "
                  f"{result['size_bytes'] / 2**20:.0f} MiB at {result['path']}")


@image.command("ls")
@json_option
@quiet_option
@reports_errors
def image_ls(as_json: bool, quiet: bool) -> None:
    """List guest images."""
    items = daemon(start=False).images()
    if as_json:
        print_json(items)
    elif quiet:
        print_ids(item["name"] for item in items)
    else:
        print_rows(("name", "kernel", "agent", "size", "key"),
                   ((item["name"], item["kernel_version"], item["agent_version"],
                     f"{item['size_bytes'] / 2**20:.0f} MiB", item["key"][:12]) for item in items))


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
@click.option("--machine", type=click.Choice(["q35", "microvm"]), default=None,
              help="machine type every child keeps: q35, or microvm (no PCI: less memory a child); "
                   "default: the daemon's vmm_machine (q35)")
@json_option
@reports_errors
def snapshot_create(tag: str, image_name: str, memory_mib: int, vcpus: int, warm_modules: tuple[str, ...],
                    warm_code: str | None, warmup_cmd: str | None, machine: str | None, as_json: bool) -> None:
    """Boot a parent, warm it and save it as TAG."""
    options: dict[str, Any] = {"image": image_name, "memory_mib": memory_mib, "vcpus": vcpus}
    if machine:
        options["machine"] = machine
    if warm_modules:
        options["warm_modules"] = list(warm_modules)
    if warm_code:
        options["warm_code"] = warm_code
    if warmup_cmd:
        options["warmup_cmd"] = warmup_cmd
    with progress_display() as on_progress:
        result = daemon().create_snapshot(tag, on_progress=on_progress, **options)
    if as_json:
        print_json(result)
        return
    console.print(f"snapshot [bold]{result['tag']}[/bold] ready (parent booted in {result['boot_seconds']:.1f} s, "
                  f"saved in {result['save_seconds'] * 1000:.0f} ms)")


def _snapshot_row(item: dict[str, Any]) -> tuple[str, ...]:
    disk = item.get("disk", {})
    return (item["tag"], item.get("parent_tag") or "-", item["status"], item["image"],
            f"{item['boot']['memory_mib']} MiB", str(item["boot"]["vcpus"]),
            f"{disk.get('logical_bytes', 0) / 2**20:.0f} MiB", f"{disk.get('physical_bytes', 0) / 2**20:.0f} MiB",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(item["created_at"])),
            item.get("machine") or "-")  # last: the columns scripts read keep their places; "-": an older daemon


def _list_snapshots(as_json: bool, quiet: bool) -> None:
    items = daemon(start=False).snapshots()
    if as_json:
        print_json(items)
    elif quiet:
        print_ids(item["tag"] for item in items)
    else:
        print_rows(("tag", "parent", "status", "image", "memory", "vcpus", "size", "on disk", "created", "machine"),
                   map(_snapshot_row, items))


@snapshot.command("ls")
@json_option
@quiet_option
@reports_errors
def snapshot_ls(as_json: bool, quiet: bool) -> None:
    """List snapshots."""
    _list_snapshots(as_json, quiet)


@snapshot.command("rm")
@click.argument("tag")
@click.option("--cascade", is_flag=True, help="also remove the snapshots branched from it")
@click.option("--force", is_flag=True, help="remove it even if snapshots were branched from it (they stop working)")
@reports_errors
def snapshot_rm(tag: str, cascade: bool, force: bool) -> None:
    """Remove a snapshot (refused while sandboxes forked from it run, or snapshots depend on it)."""
    removed = daemon().remove_snapshot(tag, cascade=cascade, force=force)
    console.print(f"removed snapshot{'s' if len(removed) > 1 else ''} {', '.join(removed)}")


@cli.command("eval")
@click.argument("sandbox_id")
@click.argument("expr")
@json_option
@reports_errors
def eval_command(sandbox_id: str, expr: str, as_json: bool) -> None:
    """Evaluate one Python expression in the sandbox's warm interpreter."""
    result = daemon().eval(sandbox_id, expr)
    _print_python_result(result, as_json)


@cli.command("run-code")
@click.argument("sandbox_id")
@click.argument("code", required=False)
@click.option("--context", default="default", show_default=True)
@json_option
@reports_errors
def run_code(sandbox_id: str, code: str | None, context: str, as_json: bool) -> None:
    """Run Python statements (CODE, or stdin) in a persistent context, like a notebook cell."""
    result = daemon().run_code(sandbox_id, code if code is not None else sys.stdin.read(), context=context)
    if not as_json:
        sys.stdout.write(result.get("stdout", ""))
        sys.stderr.write(result.get("stderr", ""))
    _print_python_result(result, as_json)


def _print_python_result(result: dict[str, Any], as_json: bool) -> None:
    """The value (or the whole result as JSON); a Python exception in the sandbox exits 1."""
    error = result.get("error")
    if as_json:
        print_json(result)
    elif error:
        err_console.print(error.get("traceback") or f"{error['name']}: {error['value']}", markup=False)
    elif result.get("value") is not None:
        console.print(result["value"], markup=False)
    if error:
        sys.exit(EXIT_FAILED)


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
@json_option
@quiet_option
@reports_errors
def files_ls(sandbox_id: str, path: str, as_json: bool, quiet: bool) -> None:
    """List a directory in the sandbox (-q: names only)."""
    entries = daemon(start=False).list_files(sandbox_id, path)
    if as_json:
        print_json(entries)
    elif quiet:
        print_ids(entry["name"] for entry in entries)
    else:
        print_rows(("name", "type", "size", "mode"),
                   ((entry["name"], entry["type"], str(entry["size"]), oct(entry["mode"] & 0o7777))
                    for entry in entries))


@files.command("stat")
@click.argument("sandbox_id")
@click.argument("path")
@json_option
@reports_errors
def files_stat(sandbox_id: str, path: str, as_json: bool) -> None:
    """A file's type, size, mode and times, as JSON (--json is accepted and changes nothing)."""
    print_json(daemon(start=False).stat(sandbox_id, path))


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
for _command in SANDBOX_COMMANDS:
    cli.add_command(_command)
for _command in SNAPSHOT_VERBS:
    snapshot.add_command(_command)
# Today's flat names keep working, hidden from help: `images` is what the reference forkd calls snapshots.
for _command, _name in ((snapshot_ls, "snapshots"), (snapshot_ls, "images"), (snapshot_rm, "rmi"),
                        *((verb, f"snapshot-{verb.name}") for verb in SNAPSHOT_VERBS)):
    cli.add_command(alias(_command, _name))
cli.add_command(exec_command)
cli.add_command(shell_command)
for _command in (*PACK_COMMANDS, *BRANCH_COMMANDS, *CLUSTER_COMMANDS, workspace, template):
    cli.add_command(_command)
attach_node_commands(cli)  # after the others: `forkd node` may be made by another module
attach_completion(cli)  # last: it walks every command


def main() -> None:
    cli(prog_name="forkd")  # also under `python -m forkd`: its usage lines and completion variable say forkd
