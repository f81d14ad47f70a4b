"""Where forkd keeps things on the host, overridable by environment variables.

State (SQLite, snapshots, per-sandbox run directories) lives under ``FORKD_HOME``; rebuildable
artefacts (guest images, downloaded packages, debootstrap trees) under ``FORKD_CACHE`` so that a
test run or CI can share them across clones; the daemon listens on ``FORKD_SOCKET``.

Clients (the CLI, the SDK) find the daemon where it listens: ``paths_from_env`` reads the same config
file the daemon reads (``FORKD_CONFIG``, else ``/etc/forkd/forkd.toml``), with the same environment
variables over it, so a systemd daemon on ``/run/forkd/forkd.sock`` is found without ``FORKD_SOCKET``.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


SYSTEM_CONFIG = Path("/etc/forkd/forkd.toml")


class ConfigFileError(ValueError):
    """The daemon's config file exists but cannot be read as TOML; the message names it."""


def config_file(env: Mapping[str, str] | None = None) -> Path | None:
    """The daemon's config file: ``FORKD_CONFIG``, else ``/etc/forkd/forkd.toml`` when it exists, else none."""
    env = os.environ if env is None else env
    if env.get("FORKD_CONFIG"):
        return Path(env["FORKD_CONFIG"])
    return SYSTEM_CONFIG if SYSTEM_CONFIG.is_file() else None


def read_config_file(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The config file's settings as TOML data ({} without a file; one the user may not read counts as none:
    its daemon's socket is root's alone then, so this user could not talk to it anyway)."""
    path = config_file(env)
    if path is None:
        return {}
    try:
        return tomllib.loads(path.read_text())
    except PermissionError:
        return {}
    except OSError as exc:
        raise ConfigFileError(f"cannot read the daemon's config file {path}: {exc.strerror} "
                              "(FORKD_CONFIG names it; unset it or point it at the daemon's config)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"the daemon's config file {path} is not valid TOML: {exc}") from None


def paths_from_env(env: Mapping[str, str] | None = None) -> Paths:
    """Where this host's daemon keeps its state and listens: environment, then its config file, then defaults
    (the daemon's own precedence, daemon/config.py, minus its command-line flags)."""
    env = os.environ if env is None else env
    settings = read_config_file(env)

    def setting(variable: str, key: str, default: str) -> Path:
        value = env.get(variable) or settings.get(key)
        return Path(value) if isinstance(value, str) and value else Path(default)

    home = setting("FORKD_HOME", "home", "/var/lib/forkd")
    cache = setting("FORKD_CACHE", "cache", "/var/cache/forkd")
    socket = setting("FORKD_SOCKET", "socket", str(home / "forkd.sock"))
    return Paths(home=home, cache=cache, socket=socket)
