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
from dataclasses import dataclass, field
from typing import Any

from . import protocol
from .channel import write_all
from .dispatch import AgentError, Handler, Request, inline

#: Largest stdout/stderr chunk carried by one event; keeps frames far below MAX_FRAME_BYTES.
OUTPUT_CHUNK_BYTES = 64 * 1024

#: How long killed processes get to release their pipes before we stop waiting.
GRACE_S = 2.0

#: Finished exec processes kept for proc.list, so a client can still see how a command ended.
FINISHED_PROCESSES_KEPT = 64

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"



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
            write_all(pipe.fileno(), data)
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

