"""Files the daemon writes are private to root, whatever umask it was started with (not only under systemd)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller, DaemonUnreachable

pytestmark = pytest.mark.timeout(120)


def test_a_daemon_started_with_a_loose_umask_writes_nothing_others_can_read(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "FORKD_HOME": str(home), "FORKD_SOCKET": str(home / "forkd.sock"),
           "FORKD_CACHE": str(tmp_path / "cache")}
    env.pop("FORKD_URL", None)
    with open(tmp_path / "daemon.log", "wb") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "forkd", "daemon"], env=env, stdout=log, stderr=log,
                                  umask=0o022)
    controller = Controller(url=f"unix://{home / 'forkd.sock'}")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                controller.health()
                break
            except DaemonUnreachable:
                assert daemon.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
                time.sleep(0.1)
        controller.snapshots()  # a request: the audit log is written
    finally:
        controller.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    made = [path for path in home.rglob("*") if not path.is_symlink()]
    assert home / "state.db" in made and home / "logs" / "audit.jsonl" in made
    loose = {str(p.relative_to(home)): oct(stat.S_IMODE(p.stat().st_mode)) for p in made
             if stat.S_IMODE(p.stat().st_mode) & 0o077}
    assert loose == {}
