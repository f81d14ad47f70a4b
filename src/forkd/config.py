"""Where forkd keeps things on the host, overridable by environment variables.

State (SQLite, snapshots, per-sandbox run directories) lives under ``FORKD_HOME``; rebuildable
artefacts (guest images, downloaded packages, debootstrap trees) under ``FORKD_CACHE`` so that a
test run or CI can share them across clones; the daemon listens on ``FORKD_SOCKET``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    home: Path
    cache: Path
    socket: Path

    @property
    def db(self) -> Path:
        return self.home / "state.db"

    @property
    def snapshots(self) -> Path:
        return self.home / "snapshots"

    @property
    def sandboxes(self) -> Path:
        return self.home / "sandboxes"

    @property
    def images(self) -> Path:
        return self.cache / "images"

    @property
    def downloads(self) -> Path:
        return self.cache / "downloads"

    @property
    def uploads(self) -> Path:
        """Where uploads wait for their guest (anonymous files: runtime/spool.py)."""
        return self.home / "uploads"

    @property
    def daemon_log(self) -> Path:
        return self.home / "daemon.log"

    @property
    def audit_log(self) -> Path:
        return self.home / "logs" / "audit.jsonl"


def paths_from_env(env: Mapping[str, str] | None = None) -> Paths:
    env = os.environ if env is None else env
    home = Path(env.get("FORKD_HOME", "/var/lib/forkd"))
    cache = Path(env.get("FORKD_CACHE", "/var/cache/forkd"))
    socket = Path(env.get("FORKD_SOCKET", str(home / "forkd.sock")))
    return Paths(home=home, cache=cache, socket=socket)
