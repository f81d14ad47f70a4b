"""pty.*: commands on a pseudo-terminal (interactive shells), with input, resize and signals.

``pty.start`` runs the command as the leader of a new session whose controlling terminal is the
PTY's slave side, then streams what the command writes as ``pty {data_b64}`` events until the
terminal closes; the request's result is the exit status. Input, resize (``TIOCSWINSZ``, which
sends the foreground group ``SIGWINCH``) and signals address the session by its pid. Like exec,
it honours ``flow.pause``/``flow.resume`` and ``cancel`` (a hang-up, then a kill).
"""

from __future__ import annotations

import fcntl
import os
import select
import selectors
import signal
import struct
import subprocess
import termios
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import protocol
from .dispatch import AgentError, Handler, Request, inline
from .processes import GRACE_S, _base_env, _exit_status, _kill_group, _own_account

MAX_SESSIONS = 64
READ_BYTES = 64 * 1024
INPUT_WAIT_S = 5.0  # a write to a terminal whose program stopped reading fails after this long
MAX_SIZE = 10_000


@dataclass
class _Session:
    proc: subprocess.Popen[bytes]
    master: int


def _winsize(rows: int, cols: int) -> bytes:
    return struct.pack("HHHH", rows, cols, 0, 0)


def _take_terminal() -> None:
    """In the child, after setsid: make the PTY (its stdin) the session's controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class PtyOps:
    def __init__(self) -> None:
        self._sessions: dict[int, _Session] = {}
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Handler]:
        return {protocol.OP_PTY_START: self.start, protocol.OP_PTY_INPUT: self.input,
                protocol.OP_PTY_RESIZE: self.resize, protocol.OP_PTY_KILL: self.kill}

    def shutdown(self) -> None:
        with self._lock:
            for pid in list(self._sessions):
                _kill_group(pid, signal.SIGKILL)

    def _size(self, req: Request) -> tuple[int, int]:
        rows, cols = req.arg("rows", int, 24, minimum=1), req.arg("cols", int, 80, minimum=1)
        if rows > MAX_SIZE or cols > MAX_SIZE:
            raise req.bad(f"rows and cols must be at most {MAX_SIZE}")
        return rows, cols

    def start(self, req: Request) -> dict[str, Any]:
        argv = req.strings("argv")
        if not argv:
            raise req.bad("argv must name a command")
        rows, cols = self._size(req)
        env = {"TERM": "xterm-256color", **_base_env(_own_account()), **req.string_map("env", {})}
        cwd = req.path("cwd", None)
        with self._lock:
            if len(self._sessions) >= MAX_SESSIONS:
                raise AgentError(protocol.ERR_BAD_REQUEST, f"at most {MAX_SESSIONS} PTY sessions; end some first")
            master, slave = os.openpty()
            try:
                fcntl.ioctl(master, termios.TIOCSWINSZ, _winsize(rows, cols))
                proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                        start_new_session=True, preexec_fn=_take_terminal)
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            os.set_blocking(master, False)
            self._sessions[proc.pid] = _Session(proc, master)
        req.emit(protocol.EVENT_STARTED, {"pid": proc.pid})
        try:
            self._stream(req, master, proc.pid)
            code, sig = _exit_status(proc.wait())
        finally:
            with self._lock:
                self._sessions.pop(proc.pid, None)
                os.close(master)
        return {"exit_code": code, "signal": sig}

    @staticmethod
    def _stream(req: Request, master: int, pid: int) -> None:
        """Forward the terminal's output until every program holding it has closed it (EIO).

        Paused (``flow.pause``), the terminal is not read, so its program blocks once the terminal's
        buffer is full. A ``cancel`` hangs the session up (SIGHUP to its group, as a closed terminal
        window does) and kills the group GRACE_S later if the terminal is still open.
        """
        control = req.control()
        hung_up = False
        kill_at: float | None = None  # cancelled: when the group is killed if the terminal is still open
        with selectors.DefaultSelector() as selector:
            selector.register(control.wake_fd, selectors.EVENT_READ, "control")
            reading = False
            while True:
                if control.cancelled and not hung_up:
                    hung_up = True
                    _kill_group(pid, signal.SIGHUP)
                    kill_at = time.monotonic() + GRACE_S
                if reading == control.paused:
                    if reading:
                        selector.unregister(master)
                    else:
                        selector.register(master, selectors.EVENT_READ, "terminal")
                    reading = not reading
                ready = selector.select(None if kill_at is None else max(0.0, kill_at - time.monotonic()))
                if kill_at is not None and time.monotonic() >= kill_at:
                    _kill_group(pid, signal.SIGKILL)
                    kill_at = None  # once: the terminal closes as the group dies
                for key, _ in ready:
                    if key.data == "control":
                        control.drain()
                        continue
                    try:
                        data = os.read(master, READ_BYTES)
                    except BlockingIOError:
                        continue
                    except OSError:  # EIO: the slave side is closed
                        return
                    if not data:
                        return
                    req.emit(protocol.EVENT_PTY, {"data_b64": protocol.b64encode(data)})

    def _session(self, req: Request) -> _Session:
        pid = req.arg("pid", int, minimum=1)
        session = self._sessions.get(pid)
        if session is None:
            raise AgentError(protocol.ERR_NOT_FOUND, f"no PTY session with pid {pid}")
        return session

    def input(self, req: Request) -> dict[str, Any]:
        session = self._session(req)
        data = memoryview(req.data("data_b64"))
        deadline = time.monotonic() + INPUT_WAIT_S
        while data:
            if not select.select([], [session.master], [], max(0.0, deadline - time.monotonic()))[1]:
                raise AgentError(protocol.ERR_TIMEOUT, "the terminal's program is not reading its input")
            try:
                data = data[os.write(session.master, data):]
            except BlockingIOError:
                continue
        return {}

    @inline
    def resize(self, req: Request) -> dict[str, Any]:
        rows, cols = self._size(req)
        fcntl.ioctl(self._session(req).master, termios.TIOCSWINSZ, _winsize(rows, cols))
        return {}

    @inline
    def kill(self, req: Request) -> dict[str, Any]:
        session = self._session(req)
        _kill_group(session.proc.pid, req.arg("signal", int, signal.SIGKILL, minimum=1))
        return {}
