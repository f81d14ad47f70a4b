"""exec and proc.*: commands run in their own session and process group, output streamed as events.

One selector per running command over its stdout, stderr and a pidfd, so nothing polls.
"""

from __future__ import annotations

import collections
import os
import pwd
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from . import protocol, warmexec
from .channel import write_all
from .dispatch import AgentError, Handler, Request, inline
from .template_process import TemplateProcess

#: Largest stdout/stderr chunk carried by one event; keeps frames far below MAX_FRAME_BYTES.
OUTPUT_CHUNK_BYTES = 64 * 1024

#: How long killed processes get to release their pipes before we stop waiting.
GRACE_S = 2.0

#: Finished exec processes kept for proc.list, so a client can still see how a command ended.
FINISHED_PROCESSES_KEPT = 64

#: How long a warm command's exit status may take to arrive from the template (busy warming).
WARM_EXIT_REPORT_S = 30.0
#: The returncode reported when a warm command's exit status never arrived (the template died).
UNKNOWN_EXIT = 255

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"



@dataclass(eq=False)
class _Process:
    """A command started by exec, with what proc.* requests need to reach it.

    ``wait`` blocks until the process has exited and returns a Popen-style returncode
    (negative: killed by that signal); ``exit_fd`` becomes readable when it exits.
    """

    pid: int
    stdin: BinaryIO
    stdout_fd: int
    stderr_fd: int
    exit_fd: int
    wait: Callable[[], int]
    command: dict[str, Any]  # {"argv": [...]} or {"shell": "..."}, plus "warm", echoed by proc.list
    started_at: float = field(default_factory=time.time)
    exit_code: int | None = None
    stdin_lock: threading.Lock = field(default_factory=threading.Lock)

    def write_stdin(self, data: bytes, eof: bool) -> None:
        """Serialised so concurrent proc.stdin requests neither interleave nor race a close."""
        with self.stdin_lock:
            if self.stdin.closed:
                raise AgentError(protocol.ERR_BAD_REQUEST, f"stdin of process {self.pid} is closed")
            write_all(self.stdin.fileno(), data)
            if eof:
                self.stdin.close()

    def feed_some(self, data: memoryview) -> memoryview | None:
        """One non-blocking write of exec's stdin_b64; None once it is all written (stdin closed)."""
        with self.stdin_lock:
            if self.stdin.closed:
                return None
            try:
                data = data[os.write(self.stdin.fileno(), data) :]
            except BlockingIOError:
                return data
            except OSError:  # the child exited or closed stdin before reading everything; its call
                data = data[:0]
            if not data:
                self.stdin.close()
                return None
            return data

    def close(self) -> None:
        with self.stdin_lock:
            self.stdin.close()
        for fd in (self.stdout_fd, self.stderr_fd, self.exit_fd):
            os.close(fd)

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


def _identity(req: Request) -> tuple[pwd.struct_passwd | None, dict[str, Any] | None]:
    """The account a command runs as, and the ids to switch to (None: stay the agent's)."""
    user = req.arg("user", str, None)
    if user is None:
        return _own_account(), None
    account = _named_account(user)
    groups = os.getgrouplist(account.pw_name, account.pw_gid)
    return account, {"uid": account.pw_uid, "gid": account.pw_gid, "groups": groups}


def _command(req: Request) -> tuple[list[str] | None, str | None]:
    argv = req.strings("argv", None)
    shell = req.arg("shell", str, None)
    if (argv is None) == (shell is None):
        raise req.bad("give exactly one of 'argv' and 'shell'")
    if argv == []:
        raise req.bad("'argv' must not be empty")
    return argv, shell


def _spawn_fresh(req: Request, argv: list[str] | None, shell: str | None) -> _Process:
    account, ids = _identity(req)
    identity = {} if ids is None else {"user": ids["uid"], "group": ids["gid"], "extra_groups": ids["groups"]}
    popen = subprocess.Popen(
        argv if argv is not None else ["/bin/sh", "-c", shell],  # type: ignore[list-item]
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        cwd=req.path("cwd", None),
        env=_base_env(account) | req.string_map("env", {}),
        start_new_session=True,  # its own process group, so kill and timeout reach children
        **identity,
    )
    assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
    command: dict[str, Any] = {"argv": argv} if argv is not None else {"shell": shell}
    stdout_fd, stderr_fd = os.dup(popen.stdout.fileno()), os.dup(popen.stderr.fileno())
    popen.stdout.close()  # the _Process owns the duplicates; these would linger until Popen is freed
    popen.stderr.close()
    return _Process(popen.pid, popen.stdin, stdout_fd, stderr_fd, os.pidfd_open(popen.pid), popen.wait, command)


def _spawn_warm(req: Request, template: TemplateProcess, argv: list[str]) -> _Process:
    """A fork of the warm template that runs ``argv`` (a python3 command line) as a fresh one would."""
    try:
        warmexec.parse_argv(argv)
    except warmexec.UnsupportedCommand as exc:
        raise req.bad(str(exc)) from None
    account, ids = _identity(req)
    cwd = req.path("cwd", None)
    if cwd is not None and not os.path.isdir(cwd):
        raise AgentError(protocol.ERR_NOT_FOUND, f"exec: no such directory: {cwd!r}", errno="ENOENT")
    env = _base_env(account) | req.string_map("env", {})
    stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
    stdout_r, stdout_w = os.pipe2(os.O_CLOEXEC)
    stderr_r, stderr_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = template.fork({"kind": "command", "argv": argv, "env": env, "cwd": cwd, "identity": ids},
                            [stdin_r, stdout_w, stderr_w])
    except BaseException:
        for fd in (stdin_w, stdout_r, stderr_r):
            os.close(fd)
        raise
    finally:
        for fd in (stdin_r, stdout_w, stderr_w):
            os.close(fd)
    try:
        exit_fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already (and reaped); its exit report says how it ended
        exit_fd = os.eventfd(1)

    def wait() -> int:
        status = template.wait_exit(pid, WARM_EXIT_REPORT_S)
        if status is None:
            return UNKNOWN_EXIT
        exit_code, sig = status
        return -sig if sig is not None else int(exit_code or 0)

    return _Process(pid, open(stdin_w, "wb", buffering=0), stdout_r, stderr_r, exit_fd, wait,
                    {"argv": argv, "warm": True})


def _stream_output(req: Request, proc: _Process, timeout_s: float | None, stdin_data: bytes | None,
                   output: protocol.OutputBudget) -> str | None:
    """Forward stdout/stderr as it arrives until the process exits and both pipes close.

    One selector over both pipes, the exit fd, stdin while exec's stdin_b64 is being written,
    and the request's Control, so nothing polls and no thread is started. Paused, the pipes are
    not read (the command blocks once they are full). At the deadline the whole process group
    is killed; a cancel sends it SIGINT and kills it GRACE_S later if it is still there.
    Descendants that escaped the group get GRACE_S to release the pipes. Returns "timeout", "cancelled" or None.
    """
    control = req.control()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ended: str | None = None
    interrupted = False  # cancelled: SIGINT sent, SIGKILL not yet
    pending = memoryview(stdin_data) if stdin_data is not None else None
    if pending is not None:
        os.set_blocking(proc.stdin.fileno(), False)
    pipes = {proc.stdout_fd: protocol.EVENT_STDOUT, proc.stderr_fd: protocol.EVENT_STDERR}
    with selectors.DefaultSelector() as selector:
        selector.register(proc.exit_fd, selectors.EVENT_READ, "exit")
        selector.register(control.wake_fd, selectors.EVENT_READ, "control")
        if pending is not None:
            selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
        open_pipes = set(pipes)
        reading = False
        while open_pipes or "exit" in [k.data for k in selector.get_map().values()]:
            if control.cancelled and ended is None:
                ended, interrupted = "cancelled", True  # gently first: SIGKILL only after GRACE_S
                _kill_group(proc.pid, signal.SIGINT)
                deadline = time.monotonic() + GRACE_S
            want_reading = not control.paused
            if want_reading != reading:
                for fd in open_pipes:
                    if want_reading:
                        selector.register(fd, selectors.EVENT_READ, pipes[fd])
                    else:
                        selector.unregister(fd)
                reading = want_reading
            ready = selector.select(None if deadline is None else max(0.0, deadline - time.monotonic()))
            # Checked whether or not anything was ready: a command that writes without pause keeps the
            # selector busy forever, and must still end at its deadline.
            if deadline is not None and time.monotonic() >= deadline:
                if interrupted:  # a cancelled command that outlived its SIGINT
                    interrupted = False
                    _kill_group(proc.pid, signal.SIGKILL)
                    deadline = time.monotonic() + GRACE_S
                    continue
                if ended is not None:
                    break  # killed, and its descendants still hold the pipes after GRACE_S
                ended = "timeout"
                _kill_group(proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + GRACE_S
            for key, _ in ready:
                if key.data == "control":
                    control.drain()
                elif key.data == "exit":
                    selector.unregister(key.fileobj)
                elif key.data == "stdin":
                    pending = proc.feed_some(pending) if pending is not None else None
                    if pending is None:
                        selector.unregister(key.fileobj)
                elif chunk := os.read(key.fd, OUTPUT_CHUNK_BYTES):
                    if forwarded := output.clip(chunk):
                        req.emit(key.data, {"data_b64": protocol.b64encode(forwarded)})
                else:  # pipe closed
                    selector.unregister(key.fileobj)
                    open_pipes.discard(key.fd)
    return ended


class ProcessTable:
    """Commands started by exec, so proc.kill / proc.stdin / proc.list can find them by pid."""

    def __init__(self, template: TemplateProcess) -> None:
        self._template = template
        self._lock = threading.Lock()
        self._by_pid: dict[int, _Process] = {}
        self._finished: collections.deque[_Process] = collections.deque()

    def exec_command(self, req: Request) -> dict[str, Any]:
        argv, shell = _command(req)
        warm = req.arg("warm", bool, False)
        stdin_data = req.data("stdin_b64", None)
        timeout_s = req.arg("timeout_s", float, None, minimum=0)
        output = protocol.OutputBudget(req.arg("output_limit", int, None, minimum=0))
        if warm and argv is None:
            raise req.bad("a warm command takes 'argv' (python3 ...), not 'shell'")
        started = time.monotonic()
        proc = _spawn_warm(req, self._template, argv) if warm else _spawn_fresh(req, argv, shell)  # type: ignore[arg-type]
        with self._lock:
            self._by_pid[proc.pid] = proc
        ended = None
        try:
            req.emit(protocol.EVENT_STARTED, {"pid": proc.pid})
            ended = _stream_output(req, proc, timeout_s, stdin_data, output)
        except BaseException:
            _kill_group(proc.pid, signal.SIGKILL)
            raise
        finally:
            returncode = proc.wait()
            exit_code, sig = _exit_status(returncode)
            self._retire(proc, exit_code)
        return {
            "exit_code": exit_code,
            "signal": sig,
            "timed_out": ended == "timeout",
            "cancelled": ended == "cancelled",
            "truncated": output.truncated,
            "duration_s": time.monotonic() - started,
        }

    def handlers(self) -> dict[str, Handler]:
        return {
            protocol.OP_EXEC: self.exec_command,
            protocol.OP_PROC_KILL: self.kill,
            protocol.OP_PROC_STDIN: self.write_stdin,
            protocol.OP_PROC_LIST: self.list_processes,
        }

    def shutdown(self) -> None:
        """Commands must not outlive the host connection that started them."""
        self.kill_all()

    @inline
    def kill(self, req: Request) -> dict[str, Any]:
        sig = req.arg("signal", int, signal.SIGKILL, minimum=0)
        os.killpg(self._running(req).pid, sig)
        return {}

    def write_stdin(self, req: Request) -> dict[str, Any]:
        data = req.data("data_b64", b"")
        eof = req.arg("eof", bool, False)
        self._running(req).write_stdin(data, eof)
        return {"written": len(data)}

    @inline
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
        proc.exit_code = exit_code
        proc.close()
        with self._lock:
            self._finished.append(proc)
            while len(self._finished) > FINISHED_PROCESSES_KEPT:
                old = self._finished.popleft()
                if self._by_pid.get(old.pid) is old:  # the pid may belong to a newer process
                    del self._by_pid[old.pid]

