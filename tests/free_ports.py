"""A TCP port for a test's server to listen on, from a range nothing else on the host picks by itself.

A port the kernel hands out for a bind to port 0 comes from its ephemeral range, the range every outgoing
connection takes its source port from too: between the probe and the server's bind, another process (a
Ray worker connecting somewhere, say) may take it. Ray's workers take 10002-19999 by default, so the ports
here lie between 20000 and the start of the ephemeral range.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000
ATTEMPTS = 200


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now on ``host``, outside the kernel's ephemeral range."""
    highest = max(_ephemeral_start(), LOWEST + 1000)
    for _ in range(ATTEMPTS):
        port = random.randrange(LOWEST, highest)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {LOWEST} and {highest} after {ATTEMPTS} attempts")
