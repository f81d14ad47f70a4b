"""The byte stream to the host: a virtio-serial port in the guest, a Unix socket or stdio in tests.

Splits the stream into request lines (bounded, so one huge frame cannot exhaust guest memory) and
keeps outgoing frames whole under one write lock.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from . import protocol

#: A virtio-serial port reads as EOF while no host is connected; this is how often we look again.
EOF_RETRY_S = 0.005

VIRTIO_PORTS_DIR = "/sys/class/virtio-ports"


def log(message: str) -> None:
    """Diagnostics go to the agent's own stderr, which init points at the guest console."""
    if sys.__stderr__ is not None:
        print(f"forkd-agent: {message}", file=sys.__stderr__, flush=True)


def write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (pipes, sockets); loop until everything is out."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def drain(fd: int) -> None:
    """Empty a non-blocking wakeup pipe."""
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


class Channel:
    """The byte stream to the host, split into lines, plus the lock that keeps frames whole."""

    def __init__(self, read_fd: int, write_fd: int, *, reconnects: bool) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._reconnects = reconnects
        self._write_lock = threading.Lock()
        self._buf = bytearray()  # read, not yet yielded

    def wait_readable(self, fds: list[Any], timeout: float) -> list[Any]:
        """The reader thread's bounded wait (it reads the host, so only it may call this): which of
        ``fds`` became readable within ``timeout``; none at once when the host has sent something."""
        if b"\n" in self._buf:
            return []
        ready = select.select([*fds, self._read_fd], [], [], timeout)[0]
        return [] if self._read_fd in ready else ready

    def send(self, frame: dict[str, Any], *, after: bytes = b"") -> None:
        """Write one frame, after ``after`` (frames encoded already) in the same write.

        A vanished host loses the frames; it must not kill the sender.
        """
        data = after + protocol.encode_frame(frame)
        with self._write_lock:
            try:
                write_all(self._write_fd, data)
            except OSError as exc:
                log(f"dropped a frame for request {frame.get('id')}: {exc}")

    def lines(self) -> Iterator[bytes]:
        """Yield request lines until the host hangs up (forever on a reconnecting port).

        Of a line longer than MAX_FRAME_BYTES only the first part is yielded, for decode_frame
        to reject; the rest is skipped, so one huge frame cannot exhaust guest memory.
        """
        buf = self._buf
        skipping = False
        while True:
            chunk = self._read()
            if not chunk:
                if not self._reconnects:
                    return
                buf.clear()  # a half-sent frame from the previous host is garbage now
                skipping = False
                time.sleep(EOF_RETRY_S)
                continue
            buf += chunk
            while (end := buf.find(b"\n")) >= 0:
                line = bytes(buf[:end])
                del buf[: end + 1]  # before the yield: what stays in the buffer is what the host sent next
                if not skipping:
                    yield line
                skipping = False
            if len(buf) > protocol.MAX_FRAME_BYTES and not skipping:
                yield bytes(buf)
                skipping = True
            if skipping:
                buf.clear()

    def _read(self) -> bytes:
        try:
            return os.read(self._read_fd, protocol.READ_CHUNK_BYTES)
        except OSError as exc:
            if not self._reconnects:
                return b""
            log(f"read from host failed: {exc}")
            time.sleep(1.0)  # a broken port would otherwise spin the EOF retry loop
            return b""


def find_virtio_port(name: str = protocol.AGENT_PORT_NAME, ports_dir: str = VIRTIO_PORTS_DIR) -> str:
    """Return the /dev node of the virtio-serial port QEMU labelled ``name``."""
    for port in sorted(os.listdir(ports_dir)):
        try:
            with open(os.path.join(ports_dir, port, "name"), encoding="utf-8") as f:
                if f.read().strip() == name:
                    return os.path.join("/dev", port)
        except OSError:
            continue
    raise FileNotFoundError(errno.ENOENT, f"no virtio-serial port named {name!r}", ports_dir)


def open_channel(transport: str) -> Channel:
    """Open the transport named on the command line (see ``--transport``)."""
    if transport == "virtio":
        fd = os.open(find_virtio_port(), os.O_RDWR | os.O_CLOEXEC)
        return Channel(fd, fd, reconnects=True)
    if transport == "stdio":
        # Keep the protocol on private fds and point 0/1 elsewhere, so a stray print or a
        # child writing to fd 1 cannot corrupt the frame stream.
        read_fd, write_fd = os.dup(0), os.dup(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(2, 1)
        os.close(devnull)
        return Channel(read_fd, write_fd, reconnects=False)
    if transport.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(transport.removeprefix("unix:"))
        fd = sock.detach()
        return Channel(fd, fd, reconnects=False)
    raise ValueError(f"unknown transport {transport!r} (want virtio, unix:PATH or stdio)")

