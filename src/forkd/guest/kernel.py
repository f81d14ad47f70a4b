"""A code-interpreter context: one process, forked from the warm template, running cells.

Stdlib only; runs only in processes forked by :mod:`template` (never in the agent). The agent
sends requests over a Unix stream socket in the guest protocol's own framing (``run_code``,
``eval``, ``reseed``) and gets the same event and terminal frames back. Cells run on the main
thread, one at a time, so a deadline or a ``cancel`` is a real signal (``SIGINT``) that also
interrupts blocking calls. A crash of native code kills only this process; the agent sees the
socket close and answers ``InterpreterCrashed``.

Rich results follow E2B's code interpreter: every ``display(obj)`` and the cell's last value
become results with keys among ``text, html, markdown, svg, png, jpeg, pdf, latex, json,
javascript, extra`` plus ``is_main_result``; matplotlib figures shown in a cell come back as PNG,
with their data as E2B's ``chart`` (:mod:`charts`). A result too large for a frame is replaced by
a text result saying so (:data:`RESULT_MAX_BYTES`), and the cell's answer carries its results up to
:data:`RESULTS_MAX_BYTES` (the rest were streamed as events and are named there by a marker), so a
cell showing a huge figure or many of them still answers.
"""

from __future__ import annotations

import ast
import base64
import builtins
import collections
import io
import itertools
import json
import linecache
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from . import protocol, reseed
from .formats import formats_of, is_figure, json_or_none, safe_repr

#: Largest text chunk carried by one output event.
OUTPUT_CHUNK_CHARS = 64 * 1024

#: The sources of the latest cells kept for tracebacks: a context serving evals for days must not grow
#: with every one it ran. A traceback through an older cell names its file and line, without the text.
CELL_SOURCES_KEPT = 10_000
CELL_SOURCES_MAX_CHARS = 16 * 1024 * 1024

#: One rich result's JSON at most (a plot with plotly.js inlined takes ~4 MiB): its event must fit in
#: a frame (``protocol.MAX_FRAME_BYTES``) next to the answer's own fields.
RESULT_MAX_BYTES = 8 * 1024 * 1024
#: What the cell's answer carries of all its results (one frame, with the error and its traceback).
RESULTS_MAX_BYTES = 12 * 1024 * 1024


_INTERNAL_FILES = frozenset({__file__, ast.__file__})


class Connection:
    """The socket to the agent: line-framed requests in, frames out (any thread may send)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._buf = bytearray()

    def send(self, *frames: dict[str, Any]) -> None:
        """Send frames in one write: each write wakes the agent, a process switch under TCG."""
        data = b"".join(map(_encode, frames))
        with self._lock:
            self._sock.sendall(data)

    def exit_on_hangup(self) -> None:
        """End this process the moment the agent's end closes, even in the middle of a cell.

        Between cells :meth:`receive` sees the hang-up and the context returns; a cell that never
        ends (a loop, a long sleep) would otherwise leave an orphan running after its agent died
        or was restarted. A thread, so only for contexts: the template must not start threads.
        """
        def watch() -> None:
            poller = select.poll()
            poller.register(self._sock, select.POLLRDHUP)  # POLLHUP and POLLERR always count
            while not poller.poll():
                pass
            os._exit(0)

        threading.Thread(target=watch, name="hangup-watch", daemon=True).start()

    def receive(self) -> dict[str, Any] | None:
        """The next request frame, or None once the agent hung up."""
        while (end := self._buf.find(b"\n")) < 0:
            chunk = self._sock.recv(protocol.READ_CHUNK_BYTES)
            if not chunk:
                return None
            self._buf += chunk
        line = bytes(self._buf[:end])
        del self._buf[: end + 1]
        return protocol.decode_frame(line)


def _encode(frame: dict[str, Any]) -> bytes:
    try:
        return protocol.encode_frame(frame)
    except (TypeError, ValueError) as exc:  # not JSON, or larger than a frame
        return protocol.encode_frame(
            protocol.error(frame.get("id"), protocol.ERR_INTERNAL, f"cannot send result: {exc}")
        )


class _Run:
    """What the request being served right now needs: its id, output budget and results."""

    def __init__(self, conn: Connection, req_id: Any, output_limit: int | None) -> None:
        self.conn = conn
        self.id = req_id
        self.budget = protocol.OutputBudget(output_limit)
        self.results: list[dict[str, Any]] = []  # what the answer carries: RESULTS_MAX_BYTES at most
        self._results_bytes = 0
        self.held: list[dict[str, Any]] = []  # sent with the terminal frame, in the same write

    def output(self, name: str, text: str) -> None:
        text = self.budget.clip(text)
        for start in range(0, len(text), OUTPUT_CHUNK_CHARS):
            self.conn.send(protocol.event(self.id, name, {"text": text[start : start + OUTPUT_CHUNK_CHARS]}))

    def result(self, result: dict[str, Any], *, last: bool = False) -> None:
        """Send a result event now, or (``last``: nothing follows but the answer) with the answer."""
        size = len(json.dumps(result))
        if size > RESULT_MAX_BYTES:
            formats = "/".join(sorted(result.keys() - {"is_main_result"}))
            result, size = _marker(result, f"result not sent: its {formats} take {size / 2**20:.1f} MiB, over the "
                                           f"{RESULT_MAX_BYTES >> 20} MiB one result may; save it to a file in the "
                                           "sandbox and read that instead")
        if self._results_bytes + size > RESULTS_MAX_BYTES:
            kept, _ = _marker(result, f"result not kept in the cell's answer: its results passed "
                                      f"{RESULTS_MAX_BYTES >> 20} MiB (a streamed run_code receives every one)")
            self.budget.truncated = True
        else:
            kept = result
            self._results_bytes += size
        self.results.append(kept)
        frame = protocol.event(self.id, protocol.EVENT_RESULT, result)
        if last:
            self.held.append(frame)
        else:
            self.conn.send(frame)


def _marker(result: dict[str, Any], why: str) -> tuple[dict[str, Any], int]:
    """A text result standing for one that was dropped, and its size."""
    marker = {"text": f"[{why}]", "is_main_result": bool(result.get("is_main_result"))}
    return marker, len(json.dumps(marker))


_current: _Run | None = None


class _OutputStream(io.TextIOBase):
    """sys.stdout / sys.stderr of a context: the current request's events, line at a time."""

    _FLUSH_AT = 8192

    def __init__(self, event_name: str, real: Any) -> None:
        self._event = event_name
        self._real = real
        self._pending: list[str] = []
        self._size = 0
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            self._pending.append(text)
            self._size += len(text)
        if "\n" in text or self._size >= self._FLUSH_AT:
            self.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            text = "".join(self._pending)
            self._pending.clear()
            self._size = 0
        run = _current
        if not text:
            return
        if run is not None:
            run.output(self._event, text)
        elif self._real is not None:  # output of a thread that outlived its cell: the console
            self._real.write(text)
            self._real.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        if self._real is None:
            raise io.UnsupportedOperation("fileno")
        return self._real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


# --------------------------------------------------------------------------------------------
# Rich results
# --------------------------------------------------------------------------------------------


def display(*objs: Any, **_: Any) -> None:
    """IPython's ``display()``: each object becomes a result of the running cell."""
    run = _current
    for obj in objs:
        formats = formats_of(obj)
        if run is None:
            print(formats.get("text", ""))
        else:
            _flush_streams()
            run.result({**formats, "is_main_result": False})


def _show_figures(*_: Any, **__: Any) -> None:
    """Replaces ``pyplot.show``: every open figure becomes a PNG result, then is closed."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    for number in pyplot.get_fignums():
        display(pyplot.figure(number))
    pyplot.close("all")


def _hook_matplotlib() -> None:
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None and pyplot.show is not _show_figures:
        pyplot.show = _show_figures


class _PyplotFinder:
    """Hooks ``pyplot.show`` the moment pyplot is imported, so ``plt.show()`` in the cell that
    imports it shows its figures too (hooking between cells only catches later cells)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "matplotlib.pyplot":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader.exec_module = _then_hook(spec.loader.exec_module)  # this spec's own loader
                return spec
        return None


def _then_hook(exec_module: Any) -> Any:
    def exec_then_hook(module: Any) -> None:
        exec_module(module)
        module.show = _show_figures

    return exec_then_hook


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------
# Running code
# --------------------------------------------------------------------------------------------


def describe_exception(exc: BaseException) -> dict[str, str]:
    """Jupyter-style error: the traceback starts at user code, not in the interpreter's own."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _INTERNAL_FILES:
        tb = tb.tb_next
    return {
        "name": type(exc).__name__,
        "value": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
    }


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _value_result(value: Any) -> dict[str, Any]:
    return {"value": None if value is None else safe_repr(value), "value_json": json_or_none(value), "error": None}


def _failure_result(exc: BaseException) -> dict[str, Any]:
    return {"value": None, "value_json": None, "error": describe_exception(exc)}


class Interrupts:
    """Deadlines and cancels as SIGINT on the main thread, raised only while user code runs.

    The agent delivers SIGINT both when a cell's deadline passes and for a ``cancel``. The deadline
    comes with the cell on CLOCK_MONOTONIC, which every process of the guest shares, so the handler
    tells them apart by the clock: TimeoutError past it, KeyboardInterrupt before, nothing between
    cells. No timer thread per cell: starting one costs a TCG guest several milliseconds.
    """

    def __init__(self) -> None:
        self._in_cell = False
        self._timeout_s: float | None = None
        self._deadline: float | None = None
        signal.signal(signal.SIGINT, self._on_sigint)

    def enter(self, timeout_s: float | None, deadline: float | None) -> None:
        """Start a cell (on the main thread, as the handler runs: no lock needed).

        An interrupt for a deadline that passed before the cell started was ignored; the clock
        says so here, and the cell ends at once.
        """
        self._timeout_s, self._deadline = timeout_s, deadline
        self._in_cell = True
        if self._expired():
            raise self._timed_out()

    def leave(self) -> None:
        self._in_cell = False

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if not self._in_cell:
            return
        if self._expired():
            raise self._timed_out()
        raise KeyboardInterrupt

    def _expired(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _timed_out(self) -> TimeoutError:
        return TimeoutError(f"cell exceeded its {self._timeout_s} s timeout")


class Kernel:
    """The interpreter state of one context and the loop that serves its requests."""

    def __init__(self, namespace: dict[str, Any], name: str) -> None:
        self.namespace = namespace
        self.name = name
        self._cell_numbers = itertools.count(1)
        self._sources: collections.deque[tuple[str, int]] = collections.deque()  # (filename, chars), oldest first
        self._source_chars = 0
        self._interrupts: Interrupts | None = None

    def serve(self, conn: Connection) -> None:
        """Answer requests until the agent hangs up (the context is deleted or the agent went)."""
        conn.exit_on_hangup()
        self._interrupts = Interrupts()
        while (frame := conn.receive()) is not None:
            marks = [["ctx_read", time.monotonic_ns()]] if protocol.traced(frame) else None
            req_id, op, args = protocol.parse_request(frame)
            if op == protocol.OP_RESEED:
                entropy = base64.b64decode(args["entropy_b64"])
                conn.send(protocol.ok(req_id, reseed.reseed_interpreter(entropy)))
                continue
            owed = args.get(protocol.CELL_RESEED)
            if owed is not None:  # before any of the cell's code runs: it must not see the copied generators
                reseed.reseed_interpreter(base64.b64decode(owed))
                if marks is not None:
                    marks.append(["ctx_reseeded", time.monotonic_ns()])
            run = _Run(conn, req_id, args.get("output_limit"))
            result = self.run(run, op, args)
            answer = protocol.ok(req_id, result)
            if marks is not None:
                marks.append(["ctx_ran", time.monotonic_ns()])
                answer[protocol.TRACE] = marks
            conn.send(*run.held, answer)

    def run(self, run: _Run, op: str, args: dict[str, Any]) -> dict[str, Any]:
        global _current
        _current = run
        source = args["code"] if op == protocol.OP_RUN_CODE else args["expr"]
        filename = self.source_name(source)
        try:
            try:
                if self._interrupts is not None:
                    self._interrupts.enter(args.get("timeout_s"), args.get("deadline"))
                if op == protocol.OP_RUN_CODE:
                    result = self._exec_cell(source, filename)
                else:
                    result = self._eval(source, filename)
            finally:
                if self._interrupts is not None:
                    self._interrupts.leave()
        except BaseException as exc:  # an interrupt between user code and leave(), or a deadline passed already
            result = _failure_result(exc)
        finally:
            _flush_streams()
            _current = None
        if op == protocol.OP_RUN_CODE:
            result["results"] = run.results
        if run.budget.truncated:
            result["truncated"] = True
        return result

    def source_name(self, source: str) -> str:
        """A unique filename whose source linecache knows, so tracebacks show the user's lines;
        the oldest cells' sources are forgotten past :data:`CELL_SOURCES_KEPT` or
        :data:`CELL_SOURCES_MAX_CHARS`."""
        filename = f"<cell-{next(self._cell_numbers)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        self._sources.append((filename, len(source)))
        self._source_chars += len(source)
        while len(self._sources) > 1 and (len(self._sources) > CELL_SOURCES_KEPT
                                          or self._source_chars > CELL_SOURCES_MAX_CHARS):
            oldest, chars = self._sources.popleft()
            self._source_chars -= chars
            linecache.cache.pop(oldest, None)
        return filename

    def _exec_cell(self, code: str, filename: str) -> dict[str, Any]:
        """Statements, then the value of a trailing expression (Jupyter semantics)."""
        try:
            tree = ast.parse(code, filename, "exec")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            _hook_matplotlib()
            exec(compile(tree, filename, "exec"), self.namespace)
            value = None
            if isinstance(last, ast.Expr):
                value = eval(compile(ast.Expression(last.value), filename, "eval"), self.namespace)
            _hook_matplotlib()
            pyplot = sys.modules.get("matplotlib.pyplot")
            if pyplot is not None and is_figure(value):
                pyplot.close(value)  # shown once, as the cell's value
            _show_figures()  # figures left open at the end of a cell are shown, as in Jupyter
            if value is not None and _current is not None:
                _flush_streams()
                _current.result({**formats_of(value), "is_main_result": True}, last=True)
            return _value_result(value)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt in user code are results too
            return _failure_result(exc)

    def _eval(self, expr: str, filename: str) -> dict[str, Any]:
        try:
            value = eval(compile(expr, filename, "eval"), self.namespace)
            return _value_result(value) | {"type": _type_name(value)}
        except BaseException as exc:
            return _failure_result(exc) | {"type": None}


def run_warmup(conn: Connection, req_id: Any, namespace: dict[str, Any], code: str) -> dict[str, Any]:
    """Run the warm-up code in the template's namespace, its output as events of ``req_id``."""
    run = _Run(conn, req_id, None)
    result = Kernel(namespace, "template").run(run, protocol.OP_RUN_CODE, {"code": code})
    if run.held:
        conn.send(*run.held)  # the template answers on its own
    return result


def install_streams(namespace: dict[str, Any]) -> None:
    """Route this process's Python output to request events and offer ``display`` to cells."""
    sys.stdin = io.StringIO()
    sys.stdout = _OutputStream(protocol.EVENT_STDOUT, sys.__stdout__)
    sys.stderr = _OutputStream(protocol.EVENT_STDERR, sys.__stderr__)
    namespace.setdefault("display", display)
    if not any(isinstance(finder, _PyplotFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PyplotFinder())


def main_namespace() -> dict[str, Any]:
    """A fresh ``__main__`` module's namespace, registered so pickling of cell classes works."""
    module = type(sys)("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    return module.__dict__

