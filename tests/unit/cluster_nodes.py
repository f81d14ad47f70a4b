"""Real forkd nodes for the cluster tests: a ``forkd daemon`` process per node on the fake VMM backend
(``FORKD_VMM=fake``: real processes answer the guest protocol, no VM), with its own FORKD_HOME and
FORKD_CACHE (holding an image the fake backend boots) and TCP with a token, in this network namespace
or its own.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd.sdk.controller import Controller, DaemonUnreachable
from conftest import _fake_image

HERE = Path(__file__).resolve().parent
SNAPSHOT_MIB = 128  # the baked snapshot's RAM: the least the API takes (sparse), its pulls are quick
SLOTS = 4  # each daemon's max_sandboxes: small, so a 30-item fan-out needs the other nodes
START_BOUND_S = 60.0
# Ray's health checks tuned for the test (docs/scale-out.md): a raylet that stops answering is declared
# dead after about period x threshold, ~4 s, instead of ~30 s by default; not tighter, so that a loaded
# machine's slow raylet is not declared dead by mistake.
HEALTH_CHECKS = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                 "health_check_timeout_ms": 1000, "health_check_failure_threshold": 4}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ForkdNode:
    """One node's daemon (and, once joined, its Ray node)."""

    name: str
    root: Path
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    port: int = field(default_factory=free_port)
    ip: str = "127.0.0.1"  # where it listens: loopback, or its network namespace's address
    netns: str | None = None  # the network namespace it runs in (None: this one)
    daemon: subprocess.Popen[bytes] | None = None
    ray_node: Any = None

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    @property
    def socket(self) -> Path:
        return self.root / "forkd.sock"

    def command(self, *argv: str) -> list[str]:
        """``argv`` run in the node's network namespace."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)

    @property
    def env(self) -> dict[str, str]:
        """What the node's Ray workers see: where their daemon is."""
        return {"FORKD_URL": self.url, "FORKD_TOKEN": self.token}

    def controller(self) -> Controller:
        """The daemon through its Unix socket: reachable from this process whatever its network namespace."""
        return Controller(url=f"unix://{self.socket}", timeout=30.0)

    def daemon_env(self) -> dict[str, str]:
        """The environment of the node's daemon (and of `forkd node start` when it starts the daemon)."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.root / "cache").exists():
            _fake_image(self.root / "cache")
        env = {**os.environ, "FORKD_HOME": str(self.home), "FORKD_CACHE": str(self.root / "cache"),
               "FORKD_SOCKET": str(self.socket), "FORKD_TOKEN": self.token, "FORKD_VMM": "fake"}
        for variable in ("FORKD_LISTEN", "FORKD_E2B_LISTEN", "FORKD_CONFIG", "FORKD_URL"):
            env.pop(variable, None)
        return env

    def start_daemon(self) -> None:
        env = self.daemon_env()
        log = open(self.root / "daemon.log", "ab")  # noqa: SIM115 - the daemon writes it until it ends
        self.daemon = subprocess.Popen(self.command(sys.executable, "-m", "forkd", "daemon", "--listen",
                                                    f"{self.ip}:{self.port}", "--max-sandboxes", str(SLOTS)),
                                       env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + START_BOUND_S
        with self.controller() as controller:
            while True:
                try:
                    controller.health()
                    return
                except DaemonUnreachable:
                    if self.daemon.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"daemon {self.name} did not start: "
                                           f"{(self.root / 'daemon.log').read_text()[-2000:]}") from None
                    time.sleep(0.2)

    def bake(self, tag: str) -> None:
        """A snapshot made by this node's daemon (the fake backend boots the fake image)."""
        with self.controller() as controller:
            controller.create_snapshot(tag, memory_mib=SNAPSHOT_MIB, warm_modules=[])

    def vmm_pids(self) -> list[int]:
        """Processes started for this node's sandboxes (FakeVmm VMMs name their run directory)."""
        return [pid for pid, cmdline in processes() if str(self.home) in cmdline and pid != self.daemon_pid]

    @property
    def daemon_pid(self) -> int | None:
        return self.daemon.pid if self.daemon else None

    def stop_daemon(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait(10)


def processes() -> list[tuple[int, str]]:
    """(pid, command line) of every process this host runs."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
            except OSError:
                continue
    return found

