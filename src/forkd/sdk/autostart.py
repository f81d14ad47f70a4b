"""Starting the local daemon on first use, so `forkd quickstart` works with nothing set up.

The daemon runs detached from the command that started it: sandboxes outlive the CLI call.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from forkd.config import Paths, paths_from_env
from forkd.extras import installed
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.controller import Controller, DaemonUnreachable

START_TIMEOUT_S = 30.0


def _log_tail(paths: Paths, limit: int = 1500) -> str:
    try:
        return paths.daemon_log.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no daemon log)"


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
    with open(paths.daemon_log, "ab") as log:
        subprocess.Popen([sys.executable, "-m", "forkd", "daemon"], stdin=subprocess.DEVNULL, stdout=log,
                         stderr=log, start_new_session=True, env=os.environ.copy())
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            controller.health()
            return controller
        except DaemonUnreachable:
            time.sleep(0.1)
    raise DaemonUnreachable(str(paths.socket), f"the daemon did not start within {START_TIMEOUT_S:.0f} s; "
                            f"its log ({paths.daemon_log}) ends with:\n{_log_tail(paths)}")
