"""Hosts stood in for by network namespaces: one per Ray node on a bridge the test makes, each node's
processes (``ray start``'s raylet and workers, the forkd daemon, its VMMs) inside its namespace, so
"every process of a node" is exactly ``ip netns pids``. Only the namespaces' own addresses are used.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

BOUND_S = 30.0


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=BOUND_S)


@dataclass
class Bridge:
    """A bridge and the namespaces plugged into it, each with one address of a private /24."""

    prefix: str = field(default_factory=lambda: f"fk{secrets.token_hex(3)}")
    subnet: str = field(default_factory=lambda: f"10.213.{random.randrange(1, 250)}")
    namespaces: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.prefix}br"

    def add(self) -> tuple[str, str]:
        """A new namespace on the bridge: (its name, its address)."""
        index = len(self.namespaces)
        netns, address, veth = f"{self.prefix}n{index}", f"{self.subnet}.{index + 1}", f"{self.prefix}v{index}"
        ip("netns", "add", netns)
        self.namespaces.append(netns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("link", "set", veth, "master", self.name, "up")
        ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        ip("-n", netns, "link", "set", "lo", "up")
        return netns, address

    def kill_all(self, netns: str) -> list[int]:
        """SIGKILL every process in ``netns`` until none is left (bounded); answers the pids killed."""
        killed: list[int] = []
        deadline = time.monotonic() + BOUND_S
        while pids := pids_in(netns):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes in {netns} survive SIGKILL: {pids}")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    continue
            time.sleep(0.1)
        return killed


def pids_in(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=BOUND_S)
    return [int(pid) for pid in done.stdout.split()]


@contextmanager
def bridge() -> Iterator[Bridge]:
    """A bridge with no address of its own; everything it made is gone afterwards."""
    made = Bridge()
    ip("link", "add", made.name, "type", "bridge")
    try:
        ip("link", "set", made.name, "up")
        yield made
    finally:
        for netns in made.namespaces:
            made.kill_all(netns)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=BOUND_S)
        subprocess.run(["ip", "link", "del", made.name], capture_output=True, timeout=BOUND_S)
