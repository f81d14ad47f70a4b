"""run_code, eval, warm and contexts.*: the agent's side of the warm interpreters.

No user code runs in the agent. The warm-up runs in the template process (:mod:`template`),
and every context is a process forked from it (:mod:`kernel`) that the agent talks to over a
Unix socket. So a cell whose native code crashes kills only its context's process: the agent
sees the socket close, learns the signal from the template (the context's parent), forks a
fresh context from the template under the same id, and answers at once with an
``InterpreterCrashed`` error result instead of letting the caller wait for its timeout.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import select
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from . import protocol
from .channel import log
from .dispatch import AgentError, Control, Deferred, Handler, Request, eager, inline
from .template_process import FrameSocket, TemplateProcess

DEFAULT_CONTEXT = protocol.DEFAULT_CONTEXT
LANGUAGE = "python"

#: After a cell's own deadline, how long it gets to stop before its context is killed and restored.
GRACE_S = 2.0

#: How long a dead interpreter's exit status may take to arrive from the template. It comes in
#: milliseconds; a loaded TCG guest can take over a second to schedule the template.
EXIT_REPORT_S = 5.0

#: How much of faulthandler's report of a crashed context is passed on.
FAULT_REPORT_BYTES = 64 * 1024

#: A cell is sent from the reader thread only up to this size (a bigger send may wait for the context).
EAGER_CELL_CHARS = 64 * 1024
#: How long the reader thread waits for a cell's answer before a worker takes over. The wait ends at once
#: when the host sends anything, so it delays no other request; a longer cell pays one hand-over.
EAGER_WAIT_S = 0.1
#: Added to it for a cell that brings its context's reseed, which runs first (cold under TCG: ~100 ms).
EAGER_RESEED_WAIT_S = 0.4
#: At most this many of a cell's frames are relayed on the reader thread; a cell printing on goes to a worker.
EAGER_FRAMES = 8


def _describe_signal(sig: int | None, exit_code: int | None) -> str:
    if sig is not None:
        try:
            return f"killed by signal {sig} ({signal.Signals(sig).name})"
        except ValueError:
            return f"killed by signal {sig}"
    if exit_code is not None:
        return f"exited with status {exit_code}"
    return "gone (its exit status is unknown)"


def _signal_name(sig: int | None) -> str | None:
    try:
        return signal.Signals(sig).name if sig is not None else None
    except ValueError:
        return None


@dataclass(eq=False)
class Context:
    """One named run_code context: its process, socket, and the lock that serialises its cells."""

    id: str
    cwd: str | None
    pid: int
    link: FrameSocket
    faults_fd: int  # read end of the pipe the context's faulthandler writes to
    created_at: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending_entropy: bytes | None = None  # owed a reseed: sent with, and applied before, its next cell
    #: Whether a cell ran in it. Until one has, nothing of the user's exists in it that could run between
    #: cells (a thread, a signal handler) and draw from its generators, so a reseed can wait for its next cell.
    ran_cells: bool = False
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "language": LANGUAGE, "cwd": self.cwd, "pid": self.pid,
                "busy": self.lock.locked(), "created_at": self.created_at}

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any] | None:
        """A request without events (reseed); None if the context died."""
        req_id = next(self.ids)
        self.link.send(protocol.request(req_id, op, args))
        while (frame := self.link.read()) is not None and not protocol.is_terminal(frame):
            pass  # an event (a print): not the answer
        return None if frame is None else frame.get("result")

    def close(self) -> None:
        self.link.close()
        if self.faults_fd >= 0:
            os.close(self.faults_fd)
            self.faults_fd = -1

    def fault_report(self) -> str:
        """What faulthandler wrote when a fatal signal hit (the Python stack), bounded."""
        try:
            return os.read(self.faults_fd, FAULT_REPORT_BYTES).decode("utf-8", "replace")
        except OSError:
            return ""


class PythonRuntime:
    """Warm interpreters: the template, the contexts forked from it, and the ops that use them."""

    def __init__(self) -> None:
        self.template = TemplateProcess()
        self._contexts: dict[str, Context] = {}
        self._lock = threading.Lock()
        try:
            self.template.start()
        except OSError as exc:
            log(f"cannot start the warm template yet: {exc}")

    def own_pids(self) -> list[int]:
        """The interpreters' own processes (the template, the contexts), which idle between calls."""
        with self._lock:
            pids = [context.pid for context in self._contexts.values()]
        template = self.template.pid
        return pids if template is None else [template, *pids]

    @property
    def warm_modules(self) -> list[str]:
        return self.template.warm_modules

    def handlers(self) -> dict[str, Handler]:
        return {
            protocol.OP_WARM: self.warm,
            protocol.OP_RUN_CODE: self.run_code,
            protocol.OP_EVAL: self.eval,
            protocol.OP_CONTEXTS_CREATE: self.create_context,
            protocol.OP_CONTEXTS_LIST: self.list_contexts,
            protocol.OP_CONTEXTS_RESTART: self.restart_context,
            protocol.OP_CONTEXTS_DELETE: self.delete_context,
        }

    def shutdown(self) -> None:
        with self._lock:
            contexts = list(self._contexts.values())
            self._contexts.clear()
        for context in contexts:
            self._kill(context)
        self.template.stop()

    # ---- ops ---------------------------------------------------------------------------------

    def warm(self, req: Request) -> dict[str, Any]:
        modules = req.strings("modules")
        code = req.arg("code", str, None)
        started = time.monotonic()
        args = {"modules": modules, "code": code}
        warmed = self.template.request(protocol.OP_WARM, args, on_event=req.emit)
        self.template.warm_log.append(args)
        for name in modules:
            if name not in self.template.warm_modules:
                self.template.warm_modules.append(name)
        return {"imported": modules, "seconds": time.monotonic() - started,
                "warm_generators": warmed.get("warm_generators", 0)}

    @eager
    def run_code(self, req: Request) -> dict[str, Any] | Deferred:
        code = req.arg("code", str)
        return self._start(req, protocol.OP_RUN_CODE, {"code": code, **self._cell_limits(req)}, len(code))

    @eager
    def eval(self, req: Request) -> dict[str, Any] | Deferred:
        expr = req.arg("expr", str)
        return self._start(req, protocol.OP_EVAL, {"expr": expr, **self._cell_limits(req)}, len(expr))

    def create_context(self, req: Request) -> dict[str, Any]:
        name = req.arg("id", str, None) or uuid.uuid4().hex
        language = req.arg("language", str, LANGUAGE)
        if language != LANGUAGE:
            raise req.bad(f"only {LANGUAGE!r} contexts exist (asked for {language!r})")
        cwd = req.path("cwd", None)
        if cwd is not None and not os.path.isdir(cwd):
            raise AgentError(protocol.ERR_NOT_FOUND, f"{req.op}: no directory {cwd!r}")
        with self._lock:
            if name in self._contexts:
                raise req.bad(f"context {name!r} exists already")
        context = self._context(req, name, cwd)
        if context.lock.acquire(blocking=False):  # (else a cell runs in it already: it started)
            try:  # the agent's own first cell (not the user's: ran_cells stays false): answered once the
                # context runs cells, so a snapshot saved next holds it idle, its cell path warmed.
                context.call(protocol.OP_EVAL, {"expr": "None", "deadline": None})
            finally:
                context.lock.release()
        return context.describe()

    @inline
    def list_contexts(self, req: Request) -> dict[str, Any]:
        with self._lock:
            contexts = sorted(self._contexts.values(), key=lambda c: c.created_at)
        return {"contexts": [c.describe() for c in contexts]}

    def restart_context(self, req: Request) -> dict[str, Any]:
        """Back to a fresh fork of the template; a running cell is ended."""
        old = self._named(req)
        self._kill(old)
        return self._replace(old).describe()

    def delete_context(self, req: Request) -> dict[str, Any]:
        context = self._named(req)
        with self._lock:
            if self._contexts.get(context.id) is context:
                del self._contexts[context.id]
        self._kill(context)
        return {}

    def reseed(self, entropy: bytes) -> dict[str, Any]:
        """Reseed every context and the template, each with its own stream derived from entropy.

        A context no cell ran in yet (the snapshot's default one) gets its seed with its next cell,
        applied before the cell runs: nothing runs in it until then, so the reseed need not wake it.
        One that ran cells may hold the user's threads or signal handlers, which draw between cells:
        it is reseeded now (busy: before its next cell). The template's forks seed themselves from the
        reseeded kernel pool as they start; only ``warm`` runs in the template itself
        (:meth:`TemplateProcess.reseed_before_warm`).
        """
        self.template.reseed_before_warm(_derive(entropy, "template"))
        with self._lock:
            contexts = list(self._contexts.values())
            for context in contexts:
                context.pending_entropy = _derive(entropy, context.id)
        reseeded = 0
        for context in contexts:
            if context.ran_cells and context.lock.acquire(blocking=False):
                try:
                    derived = self._take_entropy(context)
                    if derived is None:  # a cell took it meanwhile
                        reseeded += 1
                        continue
                    reseeded += context.call(protocol.OP_RESEED, {"entropy_b64": protocol.b64encode(derived)}) is not None
                finally:
                    context.lock.release()
        return {"python_rng": True, "template_rng": "before_next_warm", "contexts_reseeded": reseeded,
                "contexts_pending": len(contexts) - reseeded}

    def _take_entropy(self, context: Context) -> bytes | None:
        """The seed a context is owed, now its own to apply (None: none owed)."""
        with self._lock:
            entropy, context.pending_entropy = context.pending_entropy, None
            return entropy

    # ---- contexts ------------------------------------------------------------------------------

    def _cell_limits(self, req: Request) -> dict[str, Any]:
        limits = {"timeout_s": req.arg("timeout_s", float, None, minimum=0),
                  "output_limit": req.arg("output_limit", int, None, minimum=0)}
        return {k: v for k, v in limits.items() if v is not None}

    def _named(self, req: Request) -> Context:
        name = req.arg("id", str)
        with self._lock:
            context = self._contexts.get(name)
        if context is None:
            raise AgentError(protocol.ERR_NOT_FOUND, f"{req.op}: no context {name!r}")
        return context

    def _context(self, req: Request, name: str, cwd: str | None = None) -> Context:
        if not name:
            raise req.bad("'context' must not be empty")
        with self._lock:
            context = self._contexts.get(name)
            if context is None:
                context = self._contexts[name] = self._fork(name, cwd)
            return context

    def _fork(self, name: str, cwd: str | None) -> Context:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        faults_r, faults_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            pid = self.template.fork({"kind": "context", "name": name, "cwd": cwd}, [theirs.fileno(), faults_w])
        except BaseException:
            ours.close()
            os.close(faults_r)
            raise
        finally:
            theirs.close()
            os.close(faults_w)
        return Context(name, cwd, pid, FrameSocket(ours), faults_r)

    def _replace(self, old: Context) -> Context:
        """A fresh fork under the old id (unless the context was deleted meanwhile)."""
        with self._lock:
            if self._contexts.get(old.id) is not old:
                raise AgentError(protocol.ERR_NOT_FOUND, f"context {old.id!r} was deleted")
            try:
                new = self._contexts[old.id] = self._fork(old.id, old.cwd)
            except BaseException:
                del self._contexts[old.id]
                raise
            return new

    def _kill(self, context: Context) -> None:
        try:
            os.kill(context.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        context.close()
        self.template.forget_exit(context.pid)

    # ---- running cells -------------------------------------------------------------------------

    def _start(self, req: Request, op: str, args: dict[str, Any], size: int) -> dict[str, Any] | Deferred:
        """On the reader thread: send the cell if its context is idle, and answer at once if it answered.

        The reader waits up to EAGER_WAIT_S for the answer, but never while the host has sent something
        else, so a short cell is answered without waking a worker. Whatever could wait longer goes to
        a worker: a context to fork, a busy one, a big cell, a long one, a cell that
        prints on, a steered one (its flow.* or cancel ends the wait), a crash (its exit report may take
        a while).
        """
        name = req.arg("context", str, DEFAULT_CONTEXT)
        with self._lock:
            context = self._contexts.get(name)
        if context is None or size > EAGER_CELL_CHARS or not context.lock.acquire(blocking=False):
            return Deferred(self._serve, op, args)
        handed_over = False
        try:
            wait_s = EAGER_WAIT_S + (EAGER_RESEED_WAIT_S if context.pending_entropy is not None else 0.0)
            deadline = self._send_cell(req, op, args, context)
            control = req.control()
            wait_until = time.monotonic() + wait_s if deadline is None else min(deadline, time.monotonic() + wait_s)
            for _ in range(EAGER_FRAMES):
                if not context.link.buffered() and not req.wait_readable(
                        [context.link.sock], max(0.0, wait_until - time.monotonic())):
                    break
                try:
                    frame = context.link.read(timeout=0)
                except TimeoutError:  # a frame only partly written yet
                    break
                if frame is None:
                    handed_over = True
                    return Deferred(self._finish, op, context, deadline, True)
                result = self._relayed(req, frame, context, control)
                if result is not None:
                    return result
            handed_over = True
            return Deferred(self._finish, op, context, deadline, False)
        except OSError:  # the socket broke under us: the process is gone; its exit report may take a while
            handed_over = True
            return Deferred(self._finish, op, context, None, True)
        finally:
            if not handed_over:
                context.lock.release()

    def _finish(self, req: Request, op: str, context: Context, deadline: float | None, crashed: bool) -> dict[str, Any]:
        """On a worker: the rest of a cell the reader thread sent; the context's lock is released here."""
        try:
            return self._crashed(req, op, context) if crashed else self._exchange(req, op, context, deadline)
        except OSError:
            return self._crashed(req, op, context)
        finally:
            context.lock.release()

    def _serve(self, req: Request, op: str, args: dict[str, Any]) -> dict[str, Any]:
        name = req.arg("context", str, DEFAULT_CONTEXT)
        timeout_s = args.get("timeout_s")
        context = self._context(req, name)
        if not context.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise AgentError(protocol.ERR_TIMEOUT, f"context {name!r} stayed busy for {timeout_s} s")
        try:
            return self._exchange(req, op, context, self._send_cell(req, op, args, context))
        except OSError:  # the socket broke under us: the process is gone
            return self._crashed(req, op, context)
        finally:
            context.lock.release()

    def _send_cell(self, req: Request, op: str, args: dict[str, Any], context: Context) -> float | None:
        """Send one cell to its context (whose lock the caller holds); its deadline."""
        control = req.control()
        control.on_cancel(lambda: _interrupt(context.pid))
        timeout_s = args.get("timeout_s")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        cell = {**args, "deadline": deadline}
        entropy = self._take_entropy(context)
        if entropy is not None:  # the context applies it before it runs the cell
            cell[protocol.CELL_RESEED] = protocol.b64encode(entropy)
        context.ran_cells = True
        context.link.send(protocol.request(next(context.ids), op, cell, trace=req.trace is not None))
        req.mark("ctx_sent")
        return deadline

    @staticmethod
    def _relayed(req: Request, frame: dict[str, Any], context: Context, control: Control) -> dict[str, Any] | None:
        """A context's frame passed on: the cell's result for its answer, None for an event (emitted; held
        for the next write while more frames wait already)."""
        if protocol.is_terminal(frame):
            req.add_marks(frame.get(protocol.TRACE))
            req.mark("ctx_answered")
            if frame.get("ok"):
                return frame.get("result") or {}
            err = dict(frame.get("error") or {})
            raise AgentError(str(err.pop("code", protocol.ERR_INTERNAL)), str(err.pop("message", "")), **err)
        req.emit(str(frame.get("event")), frame.get("data") or {}, hold=context.link.buffered() and not control.paused)
        return None

    def _exchange(self, req: Request, op: str, context: Context, deadline: float | None) -> dict[str, Any]:
        """Relay a sent cell's frames until the answer, a crash, the deadline or a cancel.

        The cell's deadline is enforced from here: SIGINT when it passes (the context raises
        TimeoutError, as it knows the deadline too), a kill if the cell is still running GRACE_S
        later. A cancel is SIGINT at once, a kill GRACE_S later.
        """
        control = req.control()
        wake_at = deadline  # then: when a cell that ignored its interrupt is killed
        interrupted = False
        cancel_deadline: float | None = None
        while True:
            if control.cancelled and cancel_deadline is None:
                cancel_deadline = time.monotonic() + GRACE_S
            wakes = [d for d in (wake_at, cancel_deadline) if d is not None]
            wait = None if not wakes else max(0.0, min(wakes) - time.monotonic())
            if not _wait_readable(context.link, control, wait):
                now = time.monotonic()
                if wake_at is not None and now >= wake_at and not interrupted:
                    _interrupt(context.pid)
                    interrupted, wake_at = True, wake_at + GRACE_S
                elif wakes and now >= min(wakes):
                    self._kill(context)
                    self._replace(context)
                    raise AgentError(protocol.ERR_TIMEOUT, f"the cell did not stop {GRACE_S} s after its "
                                     f"{'cancel' if cancel_deadline else 'timeout'}; context {context.id!r} was "
                                     "restarted from the warm template (its variables are gone)")
                continue
            frame = context.link.read()
            if frame is None:
                return self._crashed(req, op, context)
            result = self._relayed(req, frame, context, control)
            if result is not None:
                return result

    def _crashed(self, req: Request, op: str, context: Context) -> dict[str, Any]:
        """The answer for a cell whose interpreter died: the signal, and the context restored."""
        status = self.template.wait_exit(context.pid, EXIT_REPORT_S)
        exit_code, sig = status if status is not None else (None, None)
        report = context.fault_report()
        context.close()
        try:
            self._replace(context)
            state, after = "restored", "was restored from the warm template (its variables are gone)"
        except AgentError as exc:
            state, after = "lost", f"is lost ({exc}); run code again to create it anew"
        error = {
            "name": protocol.INTERPRETER_CRASHED,
            "value": f"the interpreter of context {context.id!r} {_describe_signal(sig, exit_code)}; "
                     f"the context {after}",
            "traceback": report,
            "signal": sig,
            "signal_name": _signal_name(sig),
            "exit_code": exit_code,
            "context": state,
        }
        result: dict[str, Any] = {"value": None, "value_json": None, "error": error}
        if op == protocol.OP_RUN_CODE:
            result["results"] = []
        else:
            result["type"] = None
        return result


def _wait_readable(link: FrameSocket, control: Control, timeout: float | None) -> bool:
    """Wait for the context's next frame unless paused; False when the wait ended for another reason."""
    if link.buffered() and not control.paused:
        return True
    watched: list[Any] = [control.wake_fd] if control.paused else [link.sock, control.wake_fd]
    ready, _, _ = select.select(watched, [], [], timeout)
    if control.wake_fd in ready:
        control.drain()
    return link.sock in ready


def _interrupt(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        pass


def _derive(entropy: bytes, label: str) -> bytes:
    """Distinct, reproducible entropy per interpreter, so contexts of one VM differ too."""
    return hashlib.sha256(entropy + b"\0" + label.encode()).digest() + entropy

