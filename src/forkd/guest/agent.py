"""The forkd in-guest agent: serves the wire protocol of :mod:`protocol` inside every microVM.

Stdlib only and imported as ``forkd_guest.agent`` in the guest (hence relative imports only).
One reader thread parses frames; every request except ``ping`` runs on its own thread, so long
``exec`` and ``run_code`` requests never hold up others. Writes share one lock so frames never
interleave. A request can fail, but never the agent: every failure becomes an error frame.

Run as ``python3 -m forkd_guest.agent [--transport virtio|unix:PATH|stdio]``.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import collections
import ctypes
import errno
import fcntl
import functools
import gc
import importlib
import io
import itertools
import json
import linecache
import os
import pwd
import random
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import protocol

AGENT_VERSION = "0.2.0"  # 0.2: the guest has eth0 (snapshots without a NIC cannot load)

DEFAULT_CONTEXT = "default"

#: Largest stdout/stderr chunk carried by one event; keeps frames far below MAX_FRAME_BYTES.
OUTPUT_CHUNK_BYTES = 64 * 1024

#: A virtio-serial port reads as EOF while no host is connected; this is how often we look again.
EOF_RETRY_S = 0.005

#: How long killed processes and interrupted code get to wind down before we stop waiting.
GRACE_S = 2.0

#: Finished exec processes kept for proc.list, so a client can still see how a command ended.
FINISHED_PROCESSES_KEPT = 64

#: value_json is dropped (null) above this encoded size; ``value`` still carries the repr.
VALUE_JSON_MAX_BYTES = 1024 * 1024

#: ioctls on /dev/random from <linux/random.h>.
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207

VIRTIO_PORTS_DIR = "/sys/class/virtio-ports"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: Errors meaning "this host or user may not do that" rather than "that went wrong" (reseed).
_UNPRIVILEGED_ERRNOS = frozenset({errno.EPERM, errno.EACCES, errno.ENOTTY, errno.ENOSYS})

_REQUIRED: Any = object()
_KIND_NAMES = {
    str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array", dict: "an object"
}

Handler = Callable[["Request"], dict[str, Any]]


def _log(message: str) -> None:
    """Diagnostics go to the agent's own stderr, which init points at the guest console."""
    if sys.__stderr__ is not None:
        print(f"forkd-agent: {message}", file=sys.__stderr__, flush=True)


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (pipes, sockets); loop until everything is out."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class AgentError(Exception):
    """A failure with a protocol error code, sent to the host as the request's terminal frame."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


def _error_frame(req_id: Any, exc: Exception) -> dict[str, Any]:
    """Map any exception a handler raised to an error frame; the agent itself carries on."""
    if isinstance(exc, AgentError):
        return protocol.error(req_id, exc.code, str(exc), **exc.details)
    if isinstance(exc, (ValueError, OverflowError)):  # e.g. NUL in argv, an int too big for C
        return protocol.error(req_id, protocol.ERR_BAD_REQUEST, str(exc))
    if isinstance(exc, OSError):
        code = protocol.ERR_NOT_FOUND if isinstance(exc, FileNotFoundError) else protocol.ERR_OS
        details = {"errno": errno.errorcode.get(exc.errno, str(exc.errno))} if exc.errno else {}
        return protocol.error(req_id, code, str(exc), **details)
    return protocol.error(
        req_id, protocol.ERR_INTERNAL, f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
    )


# --------------------------------------------------------------------------------------------
# Transport and requests
# --------------------------------------------------------------------------------------------


class Channel:
    """The byte stream to the host, split into lines, plus the lock that keeps frames whole."""

    def __init__(self, read_fd: int, write_fd: int, *, reconnects: bool) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._reconnects = reconnects
        self._write_lock = threading.Lock()

    def send(self, frame: dict[str, Any]) -> None:
        """Write one frame. A vanished host loses the frame; it must not kill the sender."""
        data = protocol.encode_frame(frame)
        with self._write_lock:
            try:
                _write_all(self._write_fd, data)
            except OSError as exc:
                _log(f"dropped a frame for request {frame.get('id')}: {exc}")

    def lines(self) -> Iterator[bytes]:
        """Yield request lines until the host hangs up (forever on a reconnecting port).

        Of a line longer than MAX_FRAME_BYTES only the first part is yielded, for decode_frame
        to reject; the rest is skipped, so one huge frame cannot exhaust guest memory.
        """
        buf = bytearray()
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
                if not skipping:
                    yield bytes(buf[:end])
                skipping = False
                del buf[: end + 1]
            if len(buf) > protocol.MAX_FRAME_BYTES and not skipping:
                yield bytes(buf)
                skipping = True
            if skipping:
                buf.clear()

    def _read(self) -> bytes:
        try:
            return os.read(self._read_fd, OUTPUT_CHUNK_BYTES)
        except OSError as exc:
            if not self._reconnects:
                return b""
            _log(f"read from host failed: {exc}")
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


class Request:
    """One in-flight request: typed argument access, events, and exactly one terminal frame."""

    def __init__(self, channel: Channel, req_id: int, op: str, args: dict[str, Any]) -> None:
        self.id = req_id
        self.op = op
        self.args = args
        self._channel = channel
        self._lock = threading.Lock()
        self._done = False

    def run(self, handler: Handler) -> None:
        try:
            frame = protocol.ok(self.id, handler(self))
        except Exception as exc:
            frame = _error_frame(self.id, exc)
        with self._lock:
            self._done = True
            try:
                self._channel.send(frame)
            except (TypeError, ValueError) as exc:  # result not JSON or larger than a frame
                self._channel.send(protocol.error(self.id, protocol.ERR_INTERNAL, f"cannot send result: {exc}"))

    def emit(self, name: str, data: dict[str, Any]) -> None:
        """Send an event; dropped once the terminal frame is out (code that outlived a timeout)."""
        with self._lock:
            if not self._done:
                self._channel.send(protocol.event(self.id, name, data))

    def bad(self, message: str) -> AgentError:
        return AgentError(protocol.ERR_BAD_REQUEST, f"{self.op}: {message}")

    def arg(self, name: str, kind: type, default: Any = _REQUIRED, *, minimum: float | None = None) -> Any:
        """Return args[name] checked against a JSON kind (``float`` means any number).

        JSON null counts as absent, so clients may send optional fields as null.
        """
        value = self.args.get(name)
        if value is None:
            if default is _REQUIRED:
                raise self.bad(f"missing argument {name!r}")
            return default
        accepted = (int, float) if kind is float else kind
        if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
            raise self.bad(f"argument {name!r} must be {_KIND_NAMES[kind]}")
        if minimum is not None and value < minimum:
            raise self.bad(f"argument {name!r} must be >= {minimum}")
        return value

    def strings(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self.arg(name, list, default)
        if value is not default and not all(isinstance(item, str) for item in value):
            raise self.bad(f"argument {name!r} must be an array of strings")
        return value

    def string_map(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self.arg(name, dict, default)
        if value is not default and not all(isinstance(item, str) for item in value.values()):
            raise self.bad(f"argument {name!r} must map strings to strings")
        return value

    def path(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self.arg(name, str, default)
        if value is not default and (not value or "\0" in value):
            raise self.bad(f"argument {name!r} must be a non-empty path without NUL bytes")
        return value

    def data(self, name: str, default: Any = _REQUIRED) -> Any:
        """Decode a ``*_b64`` argument (malformed base64 is a bad_request)."""
        value = self.arg(name, str, default)
        return value if value is default else protocol.b64decode(value)


# --------------------------------------------------------------------------------------------
# exec and proc.*
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Process:
    """A command started by exec, with what proc.* requests need to reach it."""

    popen: subprocess.Popen[bytes]
    command: dict[str, Any]  # {"argv": [...]} or {"shell": "..."}, echoed by proc.list
    started_at: float = field(default_factory=time.time)
    exit_code: int | None = None
    stdin_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def write_stdin(self, data: bytes, eof: bool) -> None:
        """Serialised so concurrent proc.stdin requests neither interleave nor race a close."""
        with self.stdin_lock:
            pipe = self.popen.stdin
            assert pipe is not None
            if pipe.closed:
                raise AgentError(protocol.ERR_BAD_REQUEST, f"stdin of process {self.pid} is closed")
            _write_all(pipe.fileno(), data)
            if eof:
                pipe.close()

    def feed_stdin(self, data: bytes) -> None:
        """Thread body for exec's stdin_b64: a child that stops reading must not stall output."""
        try:
            self.write_stdin(data, eof=True)
        except OSError:
            pass  # the child exited or closed stdin before reading everything; that is its call

    def describe(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            **self.command,
            "started_at": self.started_at,
            "running": self.exit_code is None,
            "exit_code": self.exit_code,
        }


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # every member already exited


def _exit_status(returncode: int) -> tuple[int, int | None]:
    """Popen's negative returncode for a signal death becomes the shell's 128+sig."""
    return (128 - returncode, -returncode) if returncode < 0 else (returncode, None)


def _own_account() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(os.geteuid())
    except KeyError:  # running under a uid without a passwd entry
        return None


def _named_account(user: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(user)
    except KeyError:
        raise AgentError(protocol.ERR_BAD_REQUEST, f"exec: no such user {user!r}") from None


def _base_env(account: pwd.struct_passwd | None) -> dict[str, str]:
    """A clean environment: commands must not inherit the agent's own (PYTHONPATH etc.)."""
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": "/"}
    if account is not None:
        env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name)
    return env


def _spawn_args(req: Request) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate exec's arguments into Popen keyword arguments and the proc.list description."""
    argv = req.strings("argv", None)
    shell = req.arg("shell", str, None)
    if (argv is None) == (shell is None):
        raise req.bad("give exactly one of 'argv' and 'shell'")
    if argv == []:
        raise req.bad("'argv' must not be empty")
    user = req.arg("user", str, None)
    identity: dict[str, Any] = {}
    if user is None:
        account = _own_account()
    else:
        account = _named_account(user)
        groups = os.getgrouplist(account.pw_name, account.pw_gid)
        identity = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": groups}
    popen_args: dict[str, Any] = {
        "args": argv if argv is not None else ["/bin/sh", "-c", shell],
        "stdin": subprocess.PIPE,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "bufsize": 0,
        "cwd": req.path("cwd", None),
        "env": _base_env(account) | req.string_map("env", {}),
        "start_new_session": True,  # its own process group, so kill and timeout reach children
        **identity,
    }
    return popen_args, ({"argv": argv} if argv is not None else {"shell": shell})


def _stream_output(req: Request, proc: _Process, timeout_s: float | None) -> bool:
    """Forward stdout/stderr as it arrives until the process exits and both pipes close.

    One selector over both pipes and a pidfd, so nothing polls. At the deadline the whole
    process group is killed; descendants that escaped the group get GRACE_S to release the
    pipes. Returns whether the deadline hit.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    timed_out = False
    pidfd = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.popen.stdout, selectors.EVENT_READ, protocol.EVENT_STDOUT)  # type: ignore[arg-type]
            selector.register(proc.popen.stderr, selectors.EVENT_READ, protocol.EVENT_STDERR)  # type: ignore[arg-type]
            selector.register(pidfd, selectors.EVENT_READ, None)
            while selector.get_map():
                ready = selector.select(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if not ready:
                    if timed_out:
                        break
                    timed_out = True
                    _kill_group(proc.pid, signal.SIGKILL)
                    deadline = time.monotonic() + GRACE_S
                for key, _ in ready:
                    chunk = b"" if key.data is None else os.read(key.fd, OUTPUT_CHUNK_BYTES)
                    if chunk:
                        req.emit(key.data, {"data_b64": protocol.b64encode(chunk)})
                    else:  # pipe closed, or the pidfd says the process exited
                        selector.unregister(key.fileobj)
    finally:
        os.close(pidfd)
    return timed_out


class ProcessTable:
    """Commands started by exec, so proc.kill / proc.stdin / proc.list can find them by pid."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_pid: dict[int, _Process] = {}
        self._finished: collections.deque[_Process] = collections.deque()

    def exec_command(self, req: Request) -> dict[str, Any]:
        popen_args, command = _spawn_args(req)
        stdin_data = req.data("stdin_b64", None)
        timeout_s = req.arg("timeout_s", float, None, minimum=0)
        started = time.monotonic()
        popen = subprocess.Popen(**popen_args)
        proc = _Process(popen, command)
        with self._lock:
            self._by_pid[proc.pid] = proc
        try:
            req.emit(protocol.EVENT_STARTED, {"pid": proc.pid})
            if stdin_data is not None:
                threading.Thread(target=proc.feed_stdin, args=(stdin_data,), daemon=True).start()
            timed_out = _stream_output(req, proc, timeout_s)
        except BaseException:
            _kill_group(proc.pid, signal.SIGKILL)
            raise
        finally:
            exit_code, sig = _exit_status(popen.wait())
            self._retire(proc, exit_code)
        return {
            "exit_code": exit_code,
            "signal": sig,
            "timed_out": timed_out,
            "duration_s": time.monotonic() - started,
        }

    def kill(self, req: Request) -> dict[str, Any]:
        sig = req.arg("signal", int, signal.SIGKILL, minimum=0)
        os.killpg(self._running(req).pid, sig)
        return {}

    def write_stdin(self, req: Request) -> dict[str, Any]:
        data = req.data("data_b64", b"")
        eof = req.arg("eof", bool, False)
        self._running(req).write_stdin(data, eof)
        return {"written": len(data)}

    def list_processes(self, req: Request) -> dict[str, Any]:
        with self._lock:
            procs = sorted(self._by_pid.values(), key=lambda p: p.started_at)
        return {"processes": [p.describe() for p in procs]}

    def kill_all(self) -> None:
        """On shutdown: commands must not outlive the host connection that started them."""
        with self._lock:
            running = [p for p in self._by_pid.values() if p.exit_code is None]
        for proc in running:
            _kill_group(proc.pid, signal.SIGKILL)

    def _running(self, req: Request) -> _Process:
        pid = req.arg("pid", int)
        with self._lock:
            proc = self._by_pid.get(pid)
        if proc is None or proc.exit_code is not None:
            raise AgentError(protocol.ERR_NOT_FOUND, f"{req.op}: no running exec process with pid {pid}")
        return proc

    def _retire(self, proc: _Process, exit_code: int) -> None:
        """Mark the process finished, free its pipes, and keep only the newest finished ones."""
        with proc.stdin_lock:
            proc.exit_code = exit_code
            for pipe in (proc.popen.stdin, proc.popen.stdout, proc.popen.stderr):
                if pipe is not None:
                    pipe.close()
        with self._lock:
            self._finished.append(proc)
            while len(self._finished) > FINISHED_PROCESSES_KEPT:
                old = self._finished.popleft()
                if self._by_pid.get(old.pid) is old:  # the pid may belong to a newer process
                    del self._by_pid[old.pid]


# --------------------------------------------------------------------------------------------
# run_code, eval and warm
# --------------------------------------------------------------------------------------------

_cell_output = threading.local()
_INTERNAL_FILES = frozenset({__file__, ast.__file__})


class _OutputSink:
    """One stream of one request's Python output, sent as events at line granularity."""

    _FLUSH_AT = 8192

    def __init__(self, req: Request, event_name: str) -> None:
        self._req = req
        self._event = event_name
        self._pending: list[str] = []
        self._size = 0

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._pending.append(text)
        self._size += len(text)
        if "\n" in text or self._size >= self._FLUSH_AT:
            self.flush()
        return len(text)

    def flush(self) -> None:
        text = "".join(self._pending)
        self._pending.clear()
        self._size = 0
        for start in range(0, len(text), OUTPUT_CHUNK_BYTES):
            self._req.emit(self._event, {"text": text[start : start + OUTPUT_CHUNK_BYTES]})


class _OutputRouter(io.TextIOBase):
    """Installed once as sys.stdout / sys.stderr: writes from a thread running user code go to
    that request's events, everything else to the real stream (the guest console)."""

    def __init__(self, event_name: str, real: io.TextIOBase) -> None:
        self._event = event_name
        self._real = real

    def _target(self) -> Any:
        sinks = getattr(_cell_output, "sinks", None)
        return sinks[self._event] if sinks else self._real

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._real, "encoding", "utf-8")


def _install_output_routers() -> None:
    # Cells must not block on, or steal protocol bytes from, the agent's own stdin.
    sys.stdin = io.StringIO()
    sys.stdout = _OutputRouter(protocol.EVENT_STDOUT, sys.stdout)
    sys.stderr = _OutputRouter(protocol.EVENT_STDERR, sys.stderr)


def _async_raise(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise exc_type in another thread at its next bytecode; None clears a pending one."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exc_type is None else ctypes.py_object(exc_type)
    )


def _describe_exception(exc: BaseException) -> dict[str, str]:
    """Jupyter-style error: the traceback starts at user code, not in the agent."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _INTERNAL_FILES:
        tb = tb.tb_next
    return {
        "name": type(exc).__name__,
        "value": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
    }


def _json_or_none(value: Any) -> Any:
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return value if len(encoded) <= VALUE_JSON_MAX_BYTES else None


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _value_result(value: Any) -> dict[str, Any]:
    return {"value": None if value is None else repr(value), "value_json": _json_or_none(value), "error": None}


def _failure_result(exc: BaseException) -> dict[str, Any]:
    return {"value": None, "value_json": None, "error": _describe_exception(exc)}


def _exec_cell(code: str, filename: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Run a cell: statements, then the value of a trailing expression (Jupyter semantics)."""
    try:
        tree = ast.parse(code, filename, "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, filename, "exec"), namespace)
        value = None
        if isinstance(last, ast.Expr):
            value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
        return _value_result(value)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt in user code are results too
        return _failure_result(exc)


def _eval_expression(expr: str, filename: str, namespace: dict[str, Any]) -> dict[str, Any]:
    try:
        value = eval(compile(expr, filename, "eval"), namespace)
        return _value_result(value) | {"type": _type_name(value)}
    except BaseException as exc:
        return _failure_result(exc) | {"type": None}


@dataclass(eq=False)
class _Context:
    """A persistent namespace for run_code / eval; its lock serialises the code run in it."""

    namespace: dict[str, Any] = field(default_factory=lambda: {"__name__": "__main__", "__builtins__": builtins})
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Cell:
    """One run of user code for a request, interruptible by a deadline.

    The interrupt is asynchronous, so it may land just after the user code returned; ``_leave``
    closes that window by clearing any pending interrupt under the lock ``interrupt`` takes.
    The cell owns ``context.lock`` (acquired by the caller) and releases it when it ends.
    """

    def __init__(self, req: Request, context: _Context, body: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._req = req
        self._context = context
        self._body = body
        self._guard = threading.Lock()
        self._active = True
        self.result: dict[str, Any] = {}  # set by run() on every path

    def run(self) -> None:
        sinks = {name: _OutputSink(self._req, name) for name in (protocol.EVENT_STDOUT, protocol.EVENT_STDERR)}
        _cell_output.sinks = sinks
        try:
            try:
                self.result = self._body(self._context.namespace)
            finally:
                self._leave()
        except BaseException as exc:  # the interrupt landed between user code and _leave
            self.result = _failure_result(exc)
        finally:
            _cell_output.sinks = None
            for sink in sinks.values():
                sink.flush()
            self._context.lock.release()

    def interrupt(self, thread_id: int) -> None:
        with self._guard:
            if self._active:
                _async_raise(thread_id, TimeoutError)

    def _leave(self) -> None:
        with self._guard:
            self._active = False
            _async_raise(threading.get_ident(), None)


class PythonRuntime:
    """The warm interpreter: named contexts for run_code / eval, and modules imported by warm."""

    def __init__(self) -> None:
        self.warm_modules: list[str] = []
        self._contexts: dict[str, _Context] = {}
        self._contexts_lock = threading.Lock()
        self._cell_numbers = itertools.count(1)

    def run_code(self, req: Request) -> dict[str, Any]:
        code = req.arg("code", str)
        timeout_s = req.arg("timeout_s", float, None, minimum=0)
        return self._run(req, req.arg("context", str, DEFAULT_CONTEXT), timeout_s, self._cell_body(code))

    def eval(self, req: Request) -> dict[str, Any]:
        expr = req.arg("expr", str)
        body = functools.partial(_eval_expression, expr, self._source_name(expr))
        return self._run(req, req.arg("context", str, DEFAULT_CONTEXT), None, body)

    def warm(self, req: Request) -> dict[str, Any]:
        modules = req.strings("modules")
        code = req.arg("code", str, None)
        started = time.monotonic()
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException as exc:
                raise AgentError(
                    protocol.ERR_BAD_REQUEST,
                    f"warm: cannot import {name!r}: {type(exc).__name__}: {exc}",
                    module=name,
                    error=_describe_exception(exc),
                ) from None
            if name not in self.warm_modules:
                self.warm_modules.append(name)
        with self._contexts_lock:
            for context in self._contexts.values():
                context.namespace.update(self._warm_names())
        if code is not None:
            error = self._run(req, DEFAULT_CONTEXT, None, self._cell_body(code))["error"]
            if error is not None:
                raise AgentError(
                    protocol.ERR_BAD_REQUEST, f"warm: code failed: {error['name']}: {error['value']}", error=error
                )
        # Move everything warmed so far out of the collector's reach: a full collection in a
        # forked child would otherwise touch (and so copy) every object page it inherited.
        gc.collect()
        gc.freeze()
        return {"imported": modules, "seconds": time.monotonic() - started}

    def _cell_body(self, code: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return functools.partial(_exec_cell, code, self._source_name(code))

    def _source_name(self, source: str) -> str:
        """A unique filename whose source linecache knows, so tracebacks show the user's lines."""
        filename = f"<cell-{next(self._cell_numbers)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        return filename

    def _context(self, req: Request, name: str) -> _Context:
        if not name:
            raise req.bad("'context' must not be empty")
        with self._contexts_lock:
            context = self._contexts.get(name)
            if context is None:
                context = self._contexts[name] = _Context()
                context.namespace.update(self._warm_names())
            return context

    def _warm_names(self) -> dict[str, Any]:
        """Warm modules bound by their top-level name, as ``import numpy`` would, in every context."""
        roots = {name.partition(".")[0] for name in self.warm_modules}
        return {root: sys.modules[root] for root in roots if root in sys.modules}

    def _run(
        self,
        req: Request,
        context_name: str,
        timeout_s: float | None,
        body: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> dict[str, Any]:
        """Run body in a context: one at a time per context, output streamed, deadline enforced.

        Without a deadline the request thread runs the code itself. With one, a worker runs it
        so this thread can interrupt it and, if it does not stop, answer ``timeout`` anyway.
        """
        context = self._context(req, context_name)
        if not context.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise AgentError(protocol.ERR_TIMEOUT, f"context {context_name!r} stayed busy for {timeout_s} s")
        cell = _Cell(req, context, body)
        if timeout_s is None:
            cell.run()
            return cell.result
        worker = threading.Thread(target=cell.run, name=f"cell#{req.id}", daemon=True)
        try:
            worker.start()
        except BaseException:
            context.lock.release()
            raise
        worker.join(timeout_s)
        if worker.is_alive():
            assert worker.ident is not None
            cell.interrupt(worker.ident)
            worker.join(GRACE_S)
            if worker.is_alive():
                raise AgentError(
                    protocol.ERR_TIMEOUT, f"code ignored its {timeout_s} s timeout for another {GRACE_S} s"
                )
        return cell.result


# --------------------------------------------------------------------------------------------
# reseed
# --------------------------------------------------------------------------------------------


def mix_kernel_entropy(entropy: bytes) -> None:
    """Credit entropy to the kernel pool and force a CRNG reseed (both need CAP_SYS_ADMIN).

    Without this, VMs restored from one snapshot share the CRNG state getrandom() draws from.
    """
    pool_info = bytearray(struct.pack("ii", 8 * len(entropy), len(entropy)) + entropy)
    with open("/dev/random", "wb", buffering=0) as rng:
        fcntl.ioctl(rng, RNDADDENTROPY, pool_info)
        fcntl.ioctl(rng, RNDRESEEDCRNG)


def _attempt(step: str, skipped: list[str], action: Callable[..., Any], *args: Any) -> bool:
    """Run a privileged reseed step; lacking the privilege (host tests) skips it instead."""
    try:
        action(*args)
    except OSError as exc:
        if exc.errno not in _UNPRIVILEGED_ERRNOS:
            raise
        skipped.append(step)
        return False
    return True


def _reseed_interpreter(entropy: bytes) -> dict[str, bool]:
    """Reseed the generators the warm interpreter holds, which a restore copies verbatim."""
    random.seed(entropy)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        words = random.Random(b"numpy:" + entropy)  # independent of the stream `random` yields
        numpy.random.seed([words.getrandbits(32) for _ in range(8)])
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        ssl.RAND_add(entropy, float(len(entropy)))
    return {"python_rng": True, "numpy_rng": numpy is not None, "openssl_rng": ssl is not None}


# --------------------------------------------------------------------------------------------
# files.*
# --------------------------------------------------------------------------------------------

_FILE_TYPES = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"))


def _entry(path: str, st: os.stat_result) -> dict[str, Any]:
    return {
        "name": os.path.basename(path) or path,
        "path": path,
        "type": next((name for is_type, name in _FILE_TYPES if is_type(st.st_mode)), "other"),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }


def files_read(req: Request) -> dict[str, Any]:
    path = req.path("path")
    offset = req.arg("offset", int, 0, minimum=0)
    want = min(req.arg("length", int, protocol.FILE_CHUNK_BYTES, minimum=0), protocol.FILE_CHUNK_BYTES)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        data = os.pread(fd, want, offset)
    finally:
        os.close(fd)
    # A short read means EOF; /proc-style files report size 0, so only trust size for regular files.
    eof = len(data) < want or (stat.S_ISREG(st.st_mode) and offset + len(data) >= st.st_size)
    return {"data_b64": protocol.b64encode(data), "size": st.st_size, "eof": eof}


def files_write(req: Request) -> dict[str, Any]:
    path = req.path("path")
    data = req.data("data_b64")
    offset = req.arg("offset", int, 0, minimum=0)
    append = req.arg("append", bool, False)
    truncate = req.arg("truncate", bool, True) and offset == 0 and not append
    mode = req.arg("mode", int, None, minimum=0)
    parents = req.arg("parents", bool, True)
    if append and offset:
        raise req.bad("'offset' and 'append' exclude each other")
    if parents:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else 0) | (os.O_TRUNC if truncate else 0)
    fd = os.open(path, flags, 0o666 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # the open() mode only applies to new files, and minus umask
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        _write_all(fd, data)
        return {"size": os.fstat(fd).st_size}
    finally:
        os.close(fd)


def files_list(req: Request) -> dict[str, Any]:
    with os.scandir(req.path("path")) as entries:
        listing = [_entry(entry.path, entry.stat(follow_symlinks=False)) for entry in entries]
    return {"entries": sorted(listing, key=lambda e: e["name"])}


def files_stat(req: Request) -> dict[str, Any]:
    path = req.path("path")
    return _entry(path, os.lstat(path))


def files_remove(req: Request) -> dict[str, Any]:
    path = req.path("path")
    recursive = req.arg("recursive", bool, False)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        os.unlink(path)
    elif recursive:
        shutil.rmtree(path)
    else:
        os.rmdir(path)
    return {}


def files_mkdir(req: Request) -> dict[str, Any]:
    path = req.path("path")
    exist_ok = req.arg("exist_ok", bool, True)
    if req.arg("parents", bool, True):
        os.makedirs(path, exist_ok=exist_ok)
    elif not (exist_ok and os.path.isdir(path)):
        os.mkdir(path)
    return {}


def files_rename(req: Request) -> dict[str, Any]:
    os.rename(req.path("src"), req.path("dst"))
    return {}


# --------------------------------------------------------------------------------------------
# The agent
# --------------------------------------------------------------------------------------------

#: Answered on the reader thread: readiness probes after a restore should not pay a thread start.
_INLINE_OPS = frozenset({protocol.OP_PING})


def _frame_id(frame: dict[str, Any] | None) -> int | None:
    """The id to answer a malformed frame with: its own if it had an integer one."""
    req_id = frame.get("id") if frame is not None else None
    return req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else None


class Agent:
    """Agent state plus the dispatch table from op name to handler."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.sandbox_id: str | None = None
        self.processes = ProcessTable()
        self.python = PythonRuntime()
        self.handlers: dict[str, Handler] = {
            protocol.OP_PING: self.ping,
            protocol.OP_RESEED: self.reseed,
            protocol.OP_WARM: self.python.warm,
            protocol.OP_EXEC: self.processes.exec_command,
            protocol.OP_PROC_KILL: self.processes.kill,
            protocol.OP_PROC_STDIN: self.processes.write_stdin,
            protocol.OP_PROC_LIST: self.processes.list_processes,
            protocol.OP_RUN_CODE: self.python.run_code,
            protocol.OP_EVAL: self.python.eval,
            protocol.OP_FILES_READ: files_read,
            protocol.OP_FILES_WRITE: files_write,
            protocol.OP_FILES_LIST: files_list,
            protocol.OP_FILES_STAT: files_stat,
            protocol.OP_FILES_REMOVE: files_remove,
            protocol.OP_FILES_MKDIR: files_mkdir,
            protocol.OP_FILES_RENAME: files_rename,
        }

    def serve(self, channel: Channel) -> None:
        """Dispatch request lines until the channel ends."""
        for line in channel.lines():
            if not line.strip():
                continue
            try:
                self._dispatch(channel, line)
            except Exception:  # last line of defence: the reader thread must survive anything
                _log(f"dispatch failed:\n{traceback.format_exc()}")

    def _dispatch(self, channel: Channel, line: bytes) -> None:
        frame = None
        try:
            frame = protocol.decode_frame(line)
            req_id, op, args = protocol.parse_request(frame)
        except protocol.ProtocolError as exc:
            channel.send(protocol.error(_frame_id(frame), protocol.ERR_BAD_REQUEST, str(exc)))
            return
        handler = self.handlers.get(op)
        if handler is None:
            channel.send(protocol.error(req_id, protocol.ERR_UNKNOWN_OP, f"unknown op {op!r}"))
            return
        request = Request(channel, req_id, op, args)
        if op in _INLINE_OPS:
            request.run(handler)
        else:
            threading.Thread(target=request.run, args=(handler,), name=f"{op}#{req_id}", daemon=True).start()

    def ping(self, req: Request) -> dict[str, Any]:
        return {
            "agent_version": AGENT_VERSION,
            "protocol": protocol.PROTOCOL_VERSION,
            "sandbox_id": self.sandbox_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "uptime_s": time.monotonic() - self.started,
            "warm_modules": list(self.python.warm_modules),
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
        kernel_rng = _attempt("kernel_rng", skipped, mix_kernel_entropy, entropy)
        clock = _attempt("clock", skipped, time.clock_settime_ns, time.CLOCK_REALTIME, time_ns)
        hostname_set = hostname is not None and _attempt("hostname", skipped, socket.sethostname, hostname)
        return {
            "kernel_rng": kernel_rng,
            "clock": clock,
            "hostname": hostname_set,
            **_reseed_interpreter(entropy),
            "skipped": skipped,
        }


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
    _install_output_routers()
    agent = Agent()
    _log(f"agent {AGENT_VERSION} (protocol {protocol.PROTOCOL_VERSION}) serving on {args.transport}")
    try:
        agent.serve(channel)
    finally:
        agent.processes.kill_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
