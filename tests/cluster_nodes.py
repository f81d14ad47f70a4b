"""Real forkd nodes for the cluster tests: a ``forkd daemon`` process per node with its own FORKD_HOME
and TCP with a token, in this network namespace or its own. Tier A runs them on the fake VMM backend
(``FORKD_VMM=fake``: real processes answer the guest protocol, no VM; each node's FORKD_CACHE holds an
image it boots); tier B (tests/vm) on QEMU, sharing the machine's FORKD_CACHE and its built guest image.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import _fake_image, vmm_processes_under
from free_ports import free_port

from forkd.sdk.controller import Controller, DaemonUnreachable

HERE = Path(__file__).resolve().parent
SNAPSHOT_MIB = 128  # the baked snapshot's RAM: the least the API takes (sparse), its pulls are quick
SLOTS = 4  # each daemon's max_sandboxes: small, so a 30-item fan-out needs the other nodes
START_BOUND_S = 60.0
# Ray's health checks tuned for the test (docs/scale-out.md): a raylet that stops answering is declared
# dead after about period x threshold, ~4 s, instead of ~30 s by default; not tighter, so that a loaded
# machine's slow raylet is not declared dead by mistake.
HEALTH_CHECKS = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                 "health_check_timeout_ms": 1000, "health_check_failure_threshold": 4}


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
    vmm: str = "fake"  # the daemon's FORKD_VMM: "fake" (tier A) or "qemu" (tier B)
    slots: int = SLOTS
    e2b_keys: Path | None = None  # with a key file, the daemon also serves E2B's API on e2b_port
    e2b_port: int = field(default_factory=free_port)

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
        """``argv`` run in the node's network namespace. ``nsenter``, not ``ip netns exec``: that one also
        gives the process a mount namespace of its own with a fresh /sys (no cgroup hierarchy under it,
        which QEMU children's limits need) where the children's namespaces, mounted under /run/netns,
        stay invisible to the host's checks."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", *argv] if self.netns else list(argv)

    @property
    def e2b_url(self) -> str:
        return f"http://{self.ip}:{self.e2b_port}"

    @property
    def env(self) -> dict[str, str]:
        """What the node's Ray workers see: where their daemon (and its E2B front) is."""
        return {"FORKD_URL": self.url, "FORKD_TOKEN": self.token,
                **({"FORKD_E2B_URL": self.e2b_url} if self.e2b_keys else {})}

    def controller(self) -> Controller:
        """The daemon through its Unix socket: reachable from this process whatever its network namespace."""
        return Controller(url=f"unix://{self.socket}", timeout=30.0)

    def daemon_env(self) -> dict[str, str]:
        """The environment of the node's daemon (and of `forkd node start` when it starts the daemon)."""
        self.root.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "FORKD_HOME": str(self.home), "FORKD_SOCKET": str(self.socket),
               "FORKD_TOKEN": self.token, "FORKD_VMM": self.vmm}
        if self.vmm == "fake":
            if not (self.root / "cache").exists():
                _fake_image(self.root / "cache")
            env["FORKD_CACHE"] = str(self.root / "cache")
        for variable in ("FORKD_LISTEN", "FORKD_E2B_LISTEN", "FORKD_CONFIG", "FORKD_URL"):
            env.pop(variable, None)
        return env

    def start_daemon(self) -> None:
        env = self.daemon_env()
        log = open(self.root / "daemon.log", "ab")  # noqa: SIM115 - the daemon writes it until it ends
        self.daemon = subprocess.Popen(self.command(sys.executable, "-m", "forkd", "daemon", "--listen",
                                                    f"{self.ip}:{self.port}", "--max-sandboxes", str(self.slots),
                                                    *self.e2b_options()),
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

    def e2b_options(self) -> list[str]:
        if self.e2b_keys is None:
            return []
        return ["--e2b-listen", f"{self.ip}:{self.e2b_port}", "--e2b-keys-file", str(self.e2b_keys)]

    def bake(self, tag: str, memory_mib: int = SNAPSHOT_MIB) -> None:
        """A snapshot of the default image made by this node's daemon, nothing warmed."""
        with self.controller() as controller:
            controller.create_snapshot(tag, memory_mib=memory_mib, warm_modules=[])

    def vmm_pids(self) -> list[int]:
        """Live processes started for this node's sandboxes (VMMs name their run directory or snapshot)."""
        return [pid for pid in vmm_processes_under(self.home) if pid != self.daemon_pid]

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

