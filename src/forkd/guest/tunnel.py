"""tcp.*: byte tunnels to TCP ports programs listen on inside the guest.

Children usually have no network link at all (``net=none``), so the host reaches a guest port
through the agent: ``tcp.open {port}`` connects to ``127.0.0.1:PORT`` (then ``[::1]:PORT``), emits
``started {}`` and streams what the program sends as ``data {data_b64}`` events until it closes its
side; the result is ``{"received": bytes}``. Flow control is by credit: the agent sends at most
``window`` bytes the host has not acknowledged with ``tcp.ack {tunnel, bytes}``, and stops reading
the socket meanwhile (once the kernel's buffers fill, the program's writes block), so the host
never holds more than a window per tunnel, however late its answers travel. ``cancel`` closes the
connection. ``tcp.send {tunnel, data_b64, eof}`` writes to the connection the ``tcp.open`` request
``tunnel`` holds (``eof``: then shut its write side); the host sends one at a time, in order.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import protocol
from .dispatch import AgentError, Control, Handler, Request, inline

MAX_TUNNELS = 256
DEFAULT_WINDOW = 256 * 1024
MAX_WINDOW = 8 * 1024 * 1024  # open tunnels in one guest; the host bounds each sandbox lower
READ_BYTES = 64 * 1024
SEND_WAIT_S = 30.0  # a send to a program that stopped reading fails after this long
CONNECT_TIMEOUT_S = 5.0


@dataclass
class _Tunnel:
    sock: socket.socket
    control: Control
    credit: int  # bytes the agent may still send before the host acknowledges some
    lock: threading.Lock = field(default_factory=threading.Lock)  # one send at a time; close waits for it
    closed: bool = False


def _connect(port: int) -> socket.socket:
    """A connection to the port on the guest's loopback, IPv4 first (what most servers bind)."""
    last: OSError | None = None
    for family, address in ((socket.AF_INET, ("127.0.0.1", port)), (socket.AF_INET6, ("::1", port))):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    assert last is not None
    raise AgentError(protocol.ERR_NOT_FOUND, f"nothing listens on port {port} in the sandbox ({last.strerror})",
                     errno="ECONNREFUSED")


class TunnelOps:
    def __init__(self) -> None:
        self._tunnels: dict[int, _Tunnel] = {}
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Handler]:
        return {protocol.OP_TCP_OPEN: self.open, protocol.OP_TCP_SEND: self.send, protocol.OP_TCP_ACK: self.ack}

    def shutdown(self) -> None:
        with self._lock:
            for tunnel in self._tunnels.values():
                _shut(tunnel.sock)

    def open(self, req: Request) -> dict[str, Any]:
        port = req.arg("port", int, minimum=1)
        window = req.arg("window", int, DEFAULT_WINDOW, minimum=1)
        if port > 65535 or window > MAX_WINDOW:
            raise req.bad(f"port must be at most 65535 and window at most {MAX_WINDOW}")
        with self._lock:
            if len(self._tunnels) >= MAX_TUNNELS:
                raise AgentError(protocol.ERR_BAD_REQUEST, f"at most {MAX_TUNNELS} tunnels; close some first")
        control = req.control()
        tunnel = _Tunnel(_connect(port), control, window)
        with self._lock:
            self._tunnels[req.id] = tunnel
        control.on_cancel(lambda: _shut(tunnel.sock))
        received = 0
        try:
            req.emit(protocol.EVENT_STARTED, {})
            while not control.cancelled:
                with self._lock:
                    credit = tunnel.credit
                watched = [control.wake_fd] if control.paused or credit <= 0 else [control.wake_fd, tunnel.sock]
                ready = select.select(watched, [], [])[0]
                if control.wake_fd in ready:
                    control.drain()
                    continue
                try:
                    data = tunnel.sock.recv(min(READ_BYTES, credit))
                except BlockingIOError:
                    continue
                except OSError:  # reset by the program
                    break
                if not data:
                    break
                received += len(data)
                with self._lock:
                    tunnel.credit -= len(data)
                req.emit(protocol.EVENT_DATA, {"data_b64": protocol.b64encode(data)})
        finally:
            with self._lock:
                self._tunnels.pop(req.id, None)
            _shut(tunnel.sock)  # wakes a send waiting on it
            with tunnel.lock:
                tunnel.closed = True
                tunnel.sock.close()
        return {"received": received}

    def _tunnel(self, req: Request) -> _Tunnel:
        target = req.arg("tunnel", int)
        with self._lock:
            tunnel = self._tunnels.get(target)
        if tunnel is None:
            raise AgentError(protocol.ERR_NOT_FOUND, f"no open tunnel {target}")
        return tunnel

    @inline
    def ack(self, req: Request) -> dict[str, Any]:
        """The host consumed ``bytes`` of a tunnel's data: that much more may be sent."""
        tunnel, consumed = self._tunnel(req), req.arg("bytes", int, minimum=1)
        with self._lock:
            tunnel.credit += consumed
        tunnel.control.set()  # wakes the tunnel's loop, which may read again
        return {}

    def send(self, req: Request) -> dict[str, Any]:
        target = req.arg("tunnel", int)
        data = memoryview(req.data("data_b64", None) or b"")
        eof = req.arg("eof", bool, False)
        tunnel = self._tunnel(req)
        with tunnel.lock:
            if tunnel.closed:
                raise AgentError(protocol.ERR_NOT_FOUND, f"tunnel {target} is closed")
            deadline = time.monotonic() + SEND_WAIT_S
            while data:
                if not select.select([], [tunnel.sock], [], max(0.0, deadline - time.monotonic()))[1]:
                    raise AgentError(protocol.ERR_TIMEOUT, "the program on the other end is not reading")
                try:
                    data = data[tunnel.sock.send(data):]
                except BlockingIOError:
                    continue
            if eof:
                tunnel.sock.shutdown(socket.SHUT_WR)
        return {}


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected any more, or closed
