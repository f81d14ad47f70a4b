"""``forkd doctor``: every host check with a fix hint, as the daemon sees the host when one answers.

It never starts a daemon: "no daemon" and "token rejected" are findings, not something to work around.
"""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.markup import escape

from forkd.cli.serverside import server_side
from forkd.config import paths_from_env
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.controller import Controller, DaemonUnreachable, ForkdError

console = Console(highlight=False)
COLOUR = {"ok": "green", "warn": "yellow", "fail": "red"}


def check(name: str, status: str, detail: str, fix: str = "") -> dict[str, str]:
    """One finding, shaped as the daemon answers them (``forkd.host.doctor.Check.to_dict``)."""
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def daemon_checks() -> list[dict[str, str]]:
    """The daemon's own checks plus whether it is reachable and accepts our token; local checks otherwise
    (those need ``forkd[daemon]``: a light client reads only a daemon's)."""
    connection = ConnectionConfig.from_env(request_timeout=60)
    remote = connection.socket != str(paths_from_env().socket)
    try:
        with Controller(connection=connection) as controller:
            version = controller.version()
            checks: list[dict[str, str]] = [check(**c) for c in controller.doctor()]
            checks.append(check("daemon", "ok", f"reachable at {controller.url}, forkd {version['forkd']}, "
                                                f"{version['vmm']} {version['vmm_version']}, accelerator in use: "
                                                f"{version['accelerator']}"))
            return checks
    except DaemonUnreachable as exc:
        daemon = check("daemon", "fail" if remote else "warn", exc.message,
                       "start it on that host (`forkd daemon`) or fix FORKD_URL" if remote else
                       "no local daemon runs; `forkd daemon` (or any other forkd command) starts one; "
                       "if it crashed, see its log under FORKD_HOME")
    except ForkdError as exc:
        if exc.status in (401, 403):
            token = connection.token is not None
            daemon = check("daemon", "fail", "token rejected" if token else "the daemon requires a token",
                           "set FORKD_TOKEN to the daemon's token (its token_file)" if token else
                           "export FORKD_TOKEN with the token from the daemon's token_file")
        else:
            daemon = check("daemon", "fail", f"the daemon answered {exc.status}: {exc.message}",
                           "see the daemon log under FORKD_HOME")
    with server_side("checking this host without a daemon"):
        from forkd.host.doctor import run_checks
    return [*(c.to_dict() for c in run_checks(paths_from_env())), daemon]


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="print the checks as a JSON list")
def doctor(as_json: bool) -> None:
    """Check this host: virtualization, QEMU, images, cgroups, network, memory features, disk, daemon."""
    checks = daemon_checks()
    if as_json:
        print(json.dumps(checks, indent=2))
    else:
        for found in checks:
            console.print(f"[{COLOUR[found['status']]}]{found['status']:>4}[/] {found['name']:<18} "
                          f"{escape(found['detail'])}" + (f"\n{'':23}→ {escape(found['fix'])}" if found["fix"] else ""))
    if any(c["status"] == "fail" for c in checks):
        sys.exit(1)
