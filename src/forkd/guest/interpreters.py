"""run_code, eval and warm: the warm Python interpreter and its named contexts."""

from __future__ import annotations

import ast
import builtins
import ctypes
import functools
import gc
import importlib
import io
import itertools
import json
import linecache
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import protocol
from .dispatch import AgentError, Handler, Request

DEFAULT_CONTEXT = "default"

#: Largest output chunk carried by one event.
OUTPUT_CHUNK_BYTES = 64 * 1024

#: How long interrupted code gets to wind down before the request answers anyway.
GRACE_S = 2.0

#: value_json is dropped (null) above this encoded size; ``value`` still carries the repr.
VALUE_JSON_MAX_BYTES = 1024 * 1024

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


def install_output_routers() -> None:
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

    def handlers(self) -> dict[str, Handler]:
        return {protocol.OP_WARM: self.warm, protocol.OP_RUN_CODE: self.run_code, protocol.OP_EVAL: self.eval}

    def shutdown(self) -> None:
        pass

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

