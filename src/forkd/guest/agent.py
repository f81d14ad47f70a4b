"""The forkd in-guest agent: serves the wire protocol of :mod:`protocol` inside every microVM.

Stdlib only and imported as ``forkd_guest.agent`` in the guest (hence relative imports only).
This module wires the op families together (:func:`op_families`) and owns ``ping`` and
``reseed``, which span them; :mod:`dispatch` reads and routes requests. A request can fail,
but never the agent: every failure becomes an error frame.

Run as ``python3 -m forkd_guest.agent [--transport virtio|unix:PATH|stdio]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any

from . import protocol, reseed
from .activity import ActivityOps
from .channel import log, open_channel
from .dispatch import Dispatcher, Handler, OpFamily, Request, inline
from .files import FileOps
from .interpreters import PythonRuntime
from .processes import ProcessTable
from .pty import PtyOps
from .tunnel import TunnelOps
from .watch import WatchOps


class AgentOps:
    """ping and reseed: the ops about the agent and the VM as a whole."""

    def __init__(self, python: PythonRuntime) -> None:
        self.started = time.monotonic()
        self.sandbox_id: str | None = None
        self._python = python

    def handlers(self) -> dict[str, Handler]:
        return {protocol.OP_PING: self.ping, protocol.OP_RESEED: self.reseed}

    def shutdown(self) -> None:
        pass

    @inline
    def ping(self, req: Request) -> dict[str, Any]:
        return {
            "agent_version": protocol.AGENT_VERSION,
            "protocol": protocol.PROTOCOL_VERSION,
            "sandbox_id": self.sandbox_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "uptime_s": time.monotonic() - self.started,
            "warm_modules": list(self._python.warm_modules),
            "template_pid": self._python.template.pid,
        }

    def reseed(self, req: Request) -> dict[str, Any]:
        """Make a VM restored from a shared snapshot distinct from its siblings."""
        entropy = req.data("entropy_b64")
        if not entropy:
            raise req.bad("'entropy_b64' must not be empty")
        time_ns = req.arg("time_ns", int, minimum=0)
        hostname = req.arg("hostname", str, None)
        self.sandbox_id = req.arg("sandbox_id", str, self.sandbox_id)
        skipped: list[str] = []
        kernel_rng = reseed.attempt("kernel_rng", skipped, reseed.mix_kernel_entropy, entropy)
        clock = reseed.attempt("clock", skipped, time.clock_settime_ns, time.CLOCK_REALTIME, time_ns)
        hostname_set = hostname is not None and reseed.attempt("hostname", skipped, socket.sethostname, hostname)
        return {
            "kernel_rng": kernel_rng,
            "clock": clock,
            "hostname": hostname_set,
            **self._python.reseed(entropy),
            "skipped": skipped,
        }


def op_families() -> list[OpFamily]:
    """Every op family the agent serves; registering a new op module is one line here."""
    python = PythonRuntime()
    watches = WatchOps()
    return [
        AgentOps(python),
        ProcessTable(python.template),
        python,
        FileOps(),
        watches,
        PtyOps(),
        ActivityOps(python.own_pids, watches.count),
        TunnelOps(),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forkd_guest.agent", description="The forkd in-guest agent.")
    parser.add_argument(
        "--transport",
        default="virtio",
        metavar="virtio|unix:PATH|stdio",
        help="virtio: the org.forkd.agent virtio-serial port (default); unix:PATH: connect to a "
        "Unix socket (host tests); stdio: fds 0 and 1",
    )
    args = parser.parse_args(argv)
    channel = open_channel(args.transport)
    dispatcher = Dispatcher(op_families())
    log(f"agent {protocol.AGENT_VERSION} (protocol {protocol.PROTOCOL_VERSION}) serving on {args.transport}")
    try:
        dispatcher.serve(channel)
    finally:
        dispatcher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
