"""The Debian packages forkd needs on the host, and installing them (with consent).

The list lives in ``packages.txt`` beside this file so ``scripts/setup`` (before any Python
environment exists) and ``forkd quickstart`` read the same one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

PACKAGE_LIST = Path(__file__).with_name("packages.txt")


def host_packages() -> dict[str, str]:
    """Package name → a command it provides."""
    result = {}
    for line in PACKAGE_LIST.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            package, command = line.split()
            result[package] = command
    return result


def missing_packages() -> list[str]:
    return [package for package, command in host_packages().items() if shutil.which(command) is None]


def install(packages: list[str]) -> None:
    """``apt-get install`` the packages from the machine's own apt sources; raises on failure."""
    if not packages:
        return
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], check=True, env=env)
