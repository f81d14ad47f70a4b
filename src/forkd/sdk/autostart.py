"""Starting the local daemon on first use, so `forkd quickstart` works with nothing set up.

The daemon runs detached from the command that started it: sandboxes outlive the CLI call. It logs to
``HOME/daemon.log``, rotated like a configured ``log_file`` (unless its config names one); what it prints
outside logging (a config error before logging starts) goes to ``HOME/daemon.out``, emptied at each start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from forkd.config import Paths, paths_from_env, read_config_file
from forkd.extras import installed
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.controller import Controller, DaemonUnreachable

START_TIMEOUT_S = 30.0
DAEMON_OUT = "daemon.out"


def _log_tail(paths: Paths, limit: int = 1500) -> str:
    tails = []
    for path in (paths.daemon_log, paths.home / DAEMON_OUT):
        try:
            with open(path, "rb") as file:
                file.seek(max(0, file.seek(0, os.SEEK_END) - limit))
                tails.append(file.read().decode(errors="replace"))
        except OSError:
            continue
    return "\n".join(tail for tail in tails if tail.strip()) or "(no daemon log)"


def _daemon_env(paths: Paths) -> dict[str, str]:
    """The caller's environment, plus a rotated log file in HOME unless the environment or config names one."""
    env = os.environ.copy()
    if not env.get("FORKD_LOG_FILE") and "log_file" not in read_config_file(env):
        env["FORKD_LOG_FILE"] = str(paths.daemon_log)
    return env


def ensure_daemon(paths: Paths | None = None, connection: ConnectionConfig | None = None) -> Controller:
    """A controller for ``connection``'s daemon, starting it when it is this host's local daemon and none runs."""
    paths = paths or paths_from_env()
    controller = Controller(connection=connection)
    try:
        controller.health()
        return controller
    except DaemonUnreachable:
        if controller.connection.socket != str(paths.socket):
            controller.close()
            raise  # a daemon elsewhere is the user's to start
    if not installed("daemon"):
        controller.close()
        raise DaemonUnreachable(str(paths.socket), "no daemon runs here and this install cannot start one: "
                                "pip install 'forkd[daemon]' on this host, or point FORKD_URL at a running daemon")
    paths.home.mkdir(parents=True, exist_ok=True)
    with open(paths.home / DAEMON_OUT, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "forkd", "daemon"], stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=out, start_new_session=True, env=_daemon_env(paths))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            controller.health()
            return controller
        except DaemonUnreachable:
            if process.poll() is not None:  # refused to start (bad config, another daemon on this home)
                controller.close()
                raise DaemonUnreachable(str(paths.socket), f"the daemon exited at start (status {process.returncode})"
                                        f"; its log ends with:\n{_log_tail(paths)}") from None
            time.sleep(0.1)
    controller.close()
    raise DaemonUnreachable(str(paths.socket), f"the daemon did not start within {START_TIMEOUT_S:.0f} s; "
                            f"its log ({paths.daemon_log}, {DAEMON_OUT}) ends with:\n{_log_tail(paths)}")
