"""Protocol dispatch: requests, their typed arguments and error frames, and the workers that run them.

Op modules (processes, interpreters, files, ...) each provide an *op family*: an object whose
``handlers()`` maps op names to handler functions and whose ``shutdown()`` releases what it
started. The agent serves the union of its families; adding a family is one line in
:func:`forkd_guest.agent.op_families`. Handlers marked :func:`inline` are answered on the reader
thread (short ops that must stay fast even while every worker is busy); handlers marked
:func:`eager` start there and either answer at once or hand what could wait to a worker
(:class:`Deferred`); all others run on pre-started worker threads, so no request starts a thread.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from . import protocol
from .channel import Channel, drain, log

_REQUIRED: Any = object()
_KIND_NAMES = {
    str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array", dict: "an object"
}

Handler = Callable[["Request"], dict[str, Any]]

#: Workers started with the agent (so a VM restored from a snapshot has them already).
PRESTARTED_WORKERS = 8
#: More are started only while every worker is busy, up to this many; later requests queue.
MAX_WORKERS = 256
#: Wake pipes of ended requests kept for later ones: making one costs a TCG guest ~0.3 ms.
SPARE_WAKE_PIPES = 16


class OpFamily(Protocol):
    """What an op module hands the agent."""

    def handlers(self) -> dict[str, Handler]: ...

    def shutdown(self) -> None: ...


def inline(handler: Handler) -> Handler:
    """Mark a handler as short and non-blocking: it runs on the reader thread, never queued."""
    handler.inline = True  # type: ignore[attr-defined]
    return handler


def eager(handler: Handler) -> Handler:
    """Mark a handler that starts on the reader thread and never blocks there: it answers at once, or
    returns a :class:`Deferred` for a worker to finish (a wait, a fork, anything that may take long).

    Each hand-over to a worker costs a TCG guest ~0.5 ms (a futex wake, the GIL passed on, a thread
    switch), the price of a whole short cell's queue hop (bench/roundtrip.py).
    """
    handler.eager = True  # type: ignore[attr-defined]
    return handler


class Deferred:
    """An eager handler's rest, for a worker: ``fn(request, *args)`` returns the result (or raises)."""

    def __init__(self, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
        self.fn = fn
        self.args = args


class AgentError(Exception):
    """A failure with a protocol error code, sent to the host as the request's terminal frame."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


def error_frame(req_id: Any, exc: Exception) -> dict[str, Any]:
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


class Control:
    """How the host steers a running request (``flow.pause``, ``flow.resume``, ``cancel``).

    An op that streams output asks its request for one and watches ``wake_fd`` in its selector:
    it becomes readable whenever the state changes. Paused, the op stops reading its process's
    output, so pipes fill and the process blocks: real back-pressure into the guest.
    """

    def __init__(self) -> None:
        self.paused = False
        self.cancelled = False
        self._on_cancel: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._woken = False
        self.wake_fd, self._wake_w = _WAKE_PIPES.take()

    def set(self, *, paused: bool | None = None, cancel: bool = False) -> None:
        with self._lock:
            if paused is not None:
                self.paused = paused
            callbacks = []
            if cancel and not self.cancelled:
                self.cancelled = True
                callbacks = list(self._on_cancel)
        for callback in callbacks:
            callback()
        with self._lock:
            if self._closed:
                return  # the request ended; its pipe may serve another one by now
            self._woken = True
            try:
                os.write(self._wake_w, b"!")
            except OSError:
                pass  # already awake

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the request is cancelled (at once if it already was)."""
        with self._lock:
            self._on_cancel.append(callback)
            cancelled = self.cancelled
        if cancelled:
            callback()

    def drain(self) -> None:
        drain(self.wake_fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            woken = self._woken
        if woken:
            self.drain()  # the next request must not wake for this one's steering
        _WAKE_PIPES.give(self.wake_fd, self._wake_w)


class _WakePipes:
    """Non-blocking pipes kept for reuse by the next requests' Controls (bounded)."""

    def __init__(self, spare: int = SPARE_WAKE_PIPES) -> None:
        self._lock = threading.Lock()
        self._pipes: list[tuple[int, int]] = []
        self._spare = spare

    def take(self) -> tuple[int, int]:
        with self._lock:
            if self._pipes:
                return self._pipes.pop()
        return os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def give(self, read_fd: int, write_fd: int) -> None:
        with self._lock:
            if len(self._pipes) < self._spare:
                self._pipes.append((read_fd, write_fd))
                return
        os.close(read_fd)
        os.close(write_fd)


_WAKE_PIPES = _WakePipes()


class Request:
    """One in-flight request: typed argument access, events, and exactly one terminal frame."""

    def __init__(self, channel: Channel, req_id: int, op: str, args: dict[str, Any],
                 inflight: Inflight | None = None) -> None:
        self.id = req_id
        self.op = op
        self.args = args
        self._channel = channel
        self._lock = threading.Lock()
        self._done = False
        self._inflight = inflight
        self._control: Control | None = None
        self._held = b""  # encoded events that go out with the next frame, in one write
        self.trace: list[list[Any]] | None = None  # [stage, ns] marks, when the host asked (protocol.TRACE)
        if inflight is not None:
            inflight.add(self)

    def mark(self, stage: str) -> None:
        """End stage ``stage`` now, in the answer's trace (if the host asked for one)."""
        if self.trace is not None and len(self.trace) < protocol.MAX_TRACE_MARKS:
            self.trace.append([stage, time.monotonic_ns()])

    def add_marks(self, marks: Any) -> None:
        """Marks another process of the guest took (a context's), checked and bounded like the host does."""
        checked = protocol.trace_marks({protocol.TRACE: marks})
        for stage, at in checked or ():
            if self.trace is not None and len(self.trace) < protocol.MAX_TRACE_MARKS:
                self.trace.append([stage, at])

    def wait_readable(self, fds: list[Any], timeout: float) -> list[Any]:
        """For an eager handler on the reader thread: which of ``fds`` became readable within ``timeout``;
        none at once when the host sends another request meanwhile (the reader must go and read it)."""
        return self._channel.wait_readable(fds, timeout)

    def control(self) -> Control:
        """This request's Control (made on first use: by the op, or by a flow.* / cancel for it)."""
        with self._lock:
            if self._control is None:
                self._control = Control()
            return self._control

    def run(self, handler: Handler) -> Deferred | None:
        """Run ``handler`` and send its answer; an eager one's :class:`Deferred` is returned unanswered."""
        self.mark("started")
        try:
            result = handler(self)
            if isinstance(result, Deferred):
                return result
            frame = protocol.ok(self.id, result)
        except Exception as exc:
            frame = error_frame(self.id, exc)
        self._answer(frame)
        return None

    def resume(self, deferred: Deferred) -> None:
        """Finish an eager handler's :class:`Deferred` (on a worker) and send its answer."""
        self.mark("resumed")
        try:
            frame = protocol.ok(self.id, deferred.fn(self, *deferred.args))
        except Exception as exc:
            frame = error_frame(self.id, exc)
        self._answer(frame)

    def _answer(self, frame: dict[str, Any]) -> None:
        if self.trace is not None:
            self.mark("handled")
            frame[protocol.TRACE] = self.trace
        if self._inflight is not None:
            self._inflight.remove(self)
        if self._control is not None:
            self._control.close()
        with self._lock:
            self._done = True
            held, self._held = self._held, b""
            try:
                self._channel.send(frame, after=held)
            except (TypeError, ValueError) as exc:  # result not JSON or larger than a frame
                error = protocol.error(self.id, protocol.ERR_INTERNAL, f"cannot send result: {exc}")
                self._channel.send(error, after=held)

    def emit(self, name: str, data: dict[str, Any], *, hold: bool = False) -> None:
        """Send an event; dropped once the terminal frame is out (code that outlived a timeout).

        ``hold``: the caller has the next frame at hand already; this one goes out with it, in one
        write (each write to the host port costs a TCG guest the better part of a millisecond).
        At most READ_CHUNK_BYTES are held; past that, events go out at once.
        """
        with self._lock:
            if self._done:
                return
            frame = protocol.event(self.id, name, data)
            if hold and len(self._held) < protocol.READ_CHUNK_BYTES:
                self._held += protocol.encode_frame(frame)
            else:
                self._channel.send(frame, after=self._held)  # raises before writing if frame is not JSON
                self._held = b""

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


class Inflight:
    """Requests that can be steered, by id, and the ops that steer them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[int, Request] = {}

    def add(self, request: Request) -> None:
        with self._lock:
            self._requests[request.id] = request

    def remove(self, request: Request) -> None:
        with self._lock:
            if self._requests.get(request.id) is request:
                del self._requests[request.id]

    def handlers(self) -> dict[str, Handler]:
        return {protocol.OP_FLOW_PAUSE: self.pause, protocol.OP_FLOW_RESUME: self.resume,
                protocol.OP_CANCEL: self.cancel}

    def shutdown(self) -> None:
        pass

    @inline
    def pause(self, req: Request) -> dict[str, Any]:
        self._target(req).set(paused=True)
        return {}

    @inline
    def resume(self, req: Request) -> dict[str, Any]:
        self._target(req).set(paused=False)
        return {}

    @inline
    def cancel(self, req: Request) -> dict[str, Any]:
        self._target(req).set(paused=False, cancel=True)
        return {}

    def _target(self, req: Request) -> Control:
        target = req.arg("id", int)
        with self._lock:
            request = self._requests.get(target)
        if request is None:
            raise AgentError(protocol.ERR_NOT_FOUND, f"{req.op}: no running request {target} to steer")
        return request.control()


class Workers:
    """Threads started before they are needed; a new one starts only while all are busy."""

    def __init__(self, count: int = PRESTARTED_WORKERS, limit: int = MAX_WORKERS) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job, minus jobs queued for them
        self._threads = 0
        self._limit = limit
        for _ in range(count):
            self._start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self._idle <= 0 and self._threads < self._limit:
                self._start()
            self._idle -= 1
        self._jobs.put((fn, args))

    def _start(self) -> None:
        self._threads += 1
        self._idle += 1
        threading.Thread(target=self._work, name=f"worker-{self._threads}", daemon=True).start()

    def _work(self) -> None:
        while True:
            fn, args = self._jobs.get()
            try:
                fn(*args)
            except BaseException:  # a worker must survive anything a job does
                log(f"worker job failed:\n{traceback.format_exc()}")
            finally:
                with self._lock:
                    self._idle += 1


def _frame_id(frame: dict[str, Any] | None) -> int | None:
    """The id to answer a malformed frame with: its own if it had an integer one."""
    req_id = frame.get("id") if isinstance(frame, dict) else None
    return req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else None


class Dispatcher:
    """Reads request lines and hands each to its handler: inline or on a worker."""

    def __init__(self, families: list[OpFamily], workers: Workers | None = None) -> None:
        self.inflight = Inflight()
        families = [self.inflight, *families]
        self.families = families
        self.handlers: dict[str, Handler] = {}
        for family in families:
            for op, handler in family.handlers().items():
                if op in self.handlers:
                    raise ValueError(f"op {op!r} is served twice")
                self.handlers[op] = handler
        self._workers = workers or Workers()

    def serve(self, channel: Channel) -> None:
        """Dispatch request lines until the channel ends."""
        for line in channel.lines():
            if not line.strip():
                continue
            try:
                self._dispatch(channel, line)
            except Exception:  # last line of defence: the reader thread must survive anything
                log(f"dispatch failed:\n{traceback.format_exc()}")

    def shutdown(self) -> None:
        for family in self.families:
            try:
                family.shutdown()
            except Exception:
                log(f"shutdown failed:\n{traceback.format_exc()}")

    def _dispatch(self, channel: Channel, line: bytes) -> None:
        read_at = time.monotonic_ns() if b'"trace"' in line else 0  # a clock read only for traced requests
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
        inline_op = getattr(handler, "inline", False)
        request = Request(channel, req_id, op, args, None if inline_op else self.inflight)
        if protocol.traced(frame):
            request.trace = [["read", read_at or time.monotonic_ns()]]
            request.mark("decoded")
        if inline_op:
            request.run(handler)
        elif getattr(handler, "eager", False):
            deferred = request.run(handler)
            if deferred is not None:
                self._workers.submit(request.resume, deferred)
        else:
            self._workers.submit(request.run, handler)
