"""The warm template: a pristine interpreter that imports the warm modules once and forks the rest.

Stdlib only; started by the agent as ``python3 -m forkd_guest.template FD AGENT_PID`` with FD one
end of a Unix socket pair. It dies with the agent (:func:`die_with`), even in the middle of a
warm-up that never returns, so a restarted agent never finds the old one's template still running.
The template runs no user code except the warm-up, starts no threads, and
serves one request at a time, so ``os.fork()`` in it is safe. Every run_code context
(:mod:`kernel`) and every warm command (:mod:`warmexec`) is a fork of it, so each starts with the
modules the warm-up imported. The template is their parent: it reaps them and reports each exit
to the agent, which is how the agent learns that an interpreter was killed by a signal.

Requests use the guest protocol's framing; file descriptors travel with them as SCM_RIGHTS:

- ``warm {modules, code}``: import, then run ``code`` in the template's ``__main__`` namespace
- ``fork {kind: "context", name, cwd}`` + 2 fds (the context's socket, a pipe for the Python stack
  ``faulthandler`` writes on a fatal signal): answers ``{pid}``
- ``fork {kind: "command", argv, env, cwd, identity}`` + 3 fds (stdin, stdout, stderr): ``{pid}``
- ``reseed {entropy_b64}``: the template's own generators (future forks inherit them)

Unsolicited frames: ``{"id": null, "event": "exit", "data": {pid, exit_code, signal}}``.
"""

from __future__ import annotations

import base64
import collections
import ctypes
import faulthandler
import gc
import importlib
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any

from . import kernel, protocol, reseed, warmexec
from .channel import drain

EVENT_EXIT = "exit"
OP_FORK = "fork"
MAX_FDS_PER_REQUEST = 3
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Template:
    """The template's state: its namespace, what a fresh interpreter looked like, its children."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn = kernel.Connection(sock)
        self.fresh = warmexec.FreshState.capture()
        self.namespace = kernel.main_namespace()
        kernel.install_streams(self.namespace)
        self.warm_modules: list[str] = []
        self._buf = bytearray()
        self._fds: collections.deque[int] = collections.deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def serve(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the agent's requests steer the template
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears it
        signal.set_wakeup_fd(self._wake_w)
        with selectors.DefaultSelector() as selector:
            selector.register(self.sock, selectors.EVENT_READ, self._read_requests)
            selector.register(self._wake_r, selectors.EVENT_READ, self._reap)
            while True:
                for key, _ in selector.select():
                    if key.data() is False:
                        return

    def _read_requests(self) -> bool:
        data, ancdata, _, _ = self.sock.recvmsg(protocol.READ_CHUNK_BYTES, socket.CMSG_SPACE(MAX_FDS_PER_REQUEST * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                self._fds.extend(int.from_bytes(payload[i : i + 4], sys.byteorder) for i in range(0, usable, 4))
        if not data:
            return False  # the agent is gone; children keep running under init
        self._buf += data
        while (end := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            self._handle(protocol.decode_frame(line))
        return True

    def _handle(self, frame: dict[str, Any]) -> None:
        req_id, op, args = protocol.parse_request(frame)
        fds = [self._fds.popleft() for _ in range(min(args.get("nfds", 0), len(self._fds)))]
        try:
            if op == OP_FORK:
                result = {"pid": self._fork(args, fds)}
            elif op == protocol.OP_WARM:
                result = self._warm(req_id, args)
            elif op == protocol.OP_RESEED:
                result = reseed.reseed_interpreter(base64.b64decode(args["entropy_b64"]))
            else:
                raise ValueError(f"unknown template op {op!r}")
            self.conn.send(protocol.ok(req_id, result))
        except _WarmFailed as exc:
            self.conn.send(protocol.error(req_id, protocol.ERR_BAD_REQUEST, str(exc), **exc.details))
        except Exception as exc:
            self.conn.send(protocol.error(req_id, protocol.ERR_INTERNAL, f"{type(exc).__name__}: {exc}",
                                          traceback=traceback.format_exc()))
        finally:
            for fd in fds:
                os.close(fd)

    def _warm(self, req_id: Any, args: dict[str, Any]) -> dict[str, Any]:
        for name in args["modules"]:
            try:
                importlib.import_module(name)
            except BaseException as exc:
                raise _WarmFailed(
                    f"warm: cannot import {name!r}: {type(exc).__name__}: {exc}",
                    module=name,
                    error=kernel.describe_exception(exc),
                ) from None
            if name not in self.warm_modules:
                self.warm_modules.append(name)
        roots = {name.partition(".")[0] for name in self.warm_modules}
        self.namespace.update({root: sys.modules[root] for root in roots if root in sys.modules})
        code = args.get("code")
        if code is not None:
            error = kernel.run_warmup(self.conn, req_id, self.namespace, code)["error"]
            if error is not None:
                raise _WarmFailed(f"warm: code failed: {error['name']}: {error['value']}", error=error)
        # Move everything warmed so far out of the collector's reach: a full collection in a
        # fork would otherwise touch (and so copy) every object page it inherited.
        gc.collect()
        generators = reseed.find_warm_generators()  # before the freeze hides them from gc.get_objects
        gc.freeze()
        return {"imported": args["modules"], "warm_generators": generators}

    def _fork(self, args: dict[str, Any], fds: list[int]) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 70  # EX_SOFTWARE: the child's setup failed
        try:
            self._become_child(fds)
            if args["kind"] == "context":
                if args.get("cwd"):
                    os.chdir(args["cwd"])
                faults = os.fdopen(fds[1], "w")
                faulthandler.enable(faults)  # a fatal signal's Python stack goes to the agent
                kernel.Kernel(self.namespace, args["name"]).serve(kernel.Connection(socket.socket(fileno=fds[0])))
                code = 0
            else:
                code = warmexec.run(self.fresh, args, fds)
        except BaseException:
            try:
                traceback.print_exc(file=sys.__stderr__)
            except BaseException:
                pass
        os._exit(code)

    def _become_child(self, fds: list[int]) -> None:
        """Drop what belongs to the template: its socket, wakeup pipe, handlers, other requests' fds."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self.sock.detach(), self._wake_r, self._wake_w, *self._fds):
            os.close(fd)
        os.setsid()
        for fd in fds:
            os.set_inheritable(fd, False)
        reseed.reseed_interpreter(os.urandom(32))  # siblings forked from one template must differ

    def _reap(self) -> bool:
        drain(self._wake_r)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return True
            if pid == 0:
                return True
            code = os.waitstatus_to_exitcode(status)
            data = {"pid": pid, "exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None}
            self.conn.send(protocol.event(None, EVENT_EXIT, data))


class _WarmFailed(Exception):
    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details


def die_with(parent_pid: int) -> None:
    """SIGKILL this process when ``parent_pid`` (the agent) dies; exit now if it already has.

    Only the agent's end of the socket closing would end the template otherwise, and a template
    busy in its warm-up never reads it. The kernel sends the signal when the *thread* that forked
    the template ends: the agent starts it from its main thread or a worker, both of which live as
    long as the agent. A parent that died before the prctl is seen as a changed parent pid.
    Forks of the template do not inherit the setting: contexts outlive a template that crashed.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    die_with(int(args[1]))
    sock = socket.socket(fileno=int(args[0]))
    Template(sock).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
