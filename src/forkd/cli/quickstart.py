"""``forkd quickstart``: from a bare host to ten forked, answering children, asking before it changes anything.

Every step is idempotent: a second run finds the packages, the image and the snapshot in place
and only forks.
"""

from __future__ import annotations

import sys
import time

import click
from rich.console import Console

from forkd.cli.serverside import server_side
from forkd.config import paths_from_env
from forkd.errors import Failure
from forkd.safetext import for_rich
from forkd.sdk.autostart import ensure_daemon
from forkd.sdk.controller import ForkdError

QUICKSTART_TAG = "quickstart"
console = Console(highlight=False)


@click.command()
@click.option("--yes", "-y", is_flag=True, help="do not ask before installing packages and building")
@click.option("-n", "count", default=10, show_default=True, help="children to fork")
@click.option("--keep", is_flag=True, help="leave the children running (default: kill them at the end)")
def quickstart(yes: bool, count: int, keep: bool) -> None:
    """Preflight, install what is missing, build the image, bake a snapshot, fork N children."""
    paths = paths_from_env()
    with server_side("`forkd quickstart`"):  # it sets up this host and starts its daemon
        from forkd.host import packages
        from forkd.host.doctor import IP_FORWARD_CHECK, PACKAGE_CHECKS, enable_ip_forward, run_checks
    checks = run_checks(paths)  # the same preflight as `forkd doctor`
    failed = [c for c in checks if c.status == "fail" and c.name not in PACKAGE_CHECKS]
    for check in failed:
        console.print(f"[red]preflight failed:[/red] {check.name}: {check.detail} → {check.fix}")
    if failed:
        sys.exit(1)
    for check in checks:
        if check.status == "warn" and check.name != IP_FORWARD_CHECK:
            console.print(f"[yellow]note:[/yellow] {check.name}: {check.detail}" + (f" → {check.fix}" if check.fix else ""))
    missing = packages.missing_packages()
    forward_off = any(c.name == IP_FORWARD_CHECK and c.status != "ok" for c in checks)
    have_image = (paths.images / "default" / "manifest.json").exists()
    plan = []
    if missing:
        plan.append(f"install Debian packages: {' '.join(missing)}")
    if forward_off:
        plan.append("enable net.ipv4.ip_forward (for sandbox networking; until the next reboot)")
    plan.append("reuse the cached guest image" if have_image else
                "build the guest image (Debian kernel + debootstrap root with python3, numpy; ~2 min)")
    plan.append(f"bake snapshot '{QUICKSTART_TAG}' if absent (boot, import numpy, save; ~1 min under TCG)")
    plan.append(f"fork {count} children and time each one's first answer")
    console.print("[bold]forkd quickstart will:[/bold]")
    for step in plan:
        console.print(f"  • {step}")
    if not yes and not click.confirm("Proceed?", default=True):
        sys.exit(1)
    try:
        packages.install(missing)
        if forward_off:
            enable_ip_forward()
        controller = ensure_daemon(paths)
        started = time.monotonic()

        def progress(line: str) -> None:
            console.print(f"[dim]{time.monotonic() - started:7.1f}s[/dim] {for_rich(line)}")

        controller.build_image(on_progress=progress, name="default")
        if not any(s["tag"] == QUICKSTART_TAG for s in controller.snapshots()):
            controller.create_snapshot(QUICKSTART_TAG, on_progress=progress)
        fork_started = time.monotonic()
        result = controller.fork(QUICKSTART_TAG, count)
        total = time.monotonic() - fork_started
        for child in result["sandboxes"]:
            answer = controller.eval(child["id"], "(__import__('socket').gethostname(), numpy.random.rand())")
            console.print(f"  {child['id']}  first answer {child['seconds_to_answer'] * 1000:6.0f} ms   "
                          f"eval → {for_rich(answer['value'])}")
        for error in result["errors"]:
            console.print(f"  [red]failed:[/red] {for_rich(Failure.from_answer(error))}")
        console.print(f"[bold]{len(result['sandboxes'])}/{count} children answering in {total:.2f} s[/bold]")
        if not keep:
            for child in result["sandboxes"]:
                controller.kill(child["id"])
        else:
            console.print("children left running: `forkd ls`, `forkd exec ID -- CMD`, `forkd kill --all`")
    except ForkdError as exc:
        console.print(f"[red]error:[/red] {for_rich(exc.message)}")
        sys.exit(1)
    if result["errors"]:
        sys.exit(1)
