"""systemd's readiness protocol (sd_notify(3)): ``READY=1`` once the daemon's sockets serve requests.

With ``Type=notify`` ``systemctl start forkd`` returns only then, so a client started right after it
finds the socket up. Outside systemd (no ``NOTIFY_SOCKET``) this does nothing. A few lines instead of
a library: one datagram to a Unix socket, its name starting with ``@`` for the abstract namespace.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("forkd.daemon")


def notify(state: str, env: dict[str, str] | None = None) -> bool:
    """Send ``state`` (``READY=1``, ``STOPPING=1``) to systemd; False when not started by it."""
    address = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), target)
    except OSError as exc:  # systemd then times the start out and says so; the daemon itself still serves
        log.warning("could not tell systemd %s on %s: %s", state, address, exc.strerror)
        return False
    return True
