"""Warm commands: a fork of the template that behaves as ``python3 ARGV`` started fresh would.

Stdlib only. :func:`parse_argv` runs in the agent (bad command lines are refused before anything
forks); :func:`run` runs in the forked child. It gives the child its own stdin/stdout/stderr,
session, cwd, environment, ``sys.argv``, ``sys.path``, a fresh ``__main__``, the signal
dispositions and warning filters a fresh interpreter starts with, then runs the code as
``-c``/``-m``/a script would and ends the way CPython's ``Py_RunMain`` does: ``SystemExit`` codes,
tracebacks with exit status 1, non-daemon threads joined, ``atexit`` handlers run, streams
flushed (exit 120 if that fails), death by ``SIGINT`` after an unhandled ``KeyboardInterrupt``.

What differs from a fresh process (docs/guest-protocol.md says when to avoid it): modules the
warm-up imported are already in ``sys.modules`` (and ran their import-time code in the
template, with the template's environment); the hash seed, ``sys.flags`` and the locale are the
template's; ``PYTHON*`` variables other than those listed in :data:`HONOURED_ENV` are ignored.
"""

from __future__ import annotations

import atexit
import dataclasses
import io
import os
import re
import runpy
import signal
import sys
import threading
import time
import warnings
from typing import Any

#: argv[0] of a warm command must name a Python 3 interpreter.
_PYTHON_NAME = re.compile(r"python(3(\.\d+)?)?")
#: Flags accepted (with their effect emulated) and those that take a value.
_FLAGS = frozenset("uBEsq")
HONOURED_ENV = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONSAFEPATH")


class UnsupportedCommand(ValueError):
    """The command line cannot run warm; the message says how to run it instead."""


@dataclasses.dataclass(frozen=True)
class Command:
    """A parsed ``python3 [flags] (-c CODE | -m MODULE | SCRIPT | - ) [args]`` command line."""

    mode: str  # "c", "m", "script" or "stdin"
    target: str  # the code, module name or script path ("-" for stdin)
    args: tuple[str, ...]
    flags: frozenset[str]
    warn_options: tuple[str, ...]
    argv: tuple[str, ...]


def parse_argv(argv: list[str]) -> Command:
    """Parse a Python command line, refusing what a fork cannot honour."""
    if not argv or not _PYTHON_NAME.fullmatch(os.path.basename(argv[0])):
        raise UnsupportedCommand("a warm command runs Python: argv must start with python3 (or python)")
    flags: set[str] = set()
    warn_options: list[str] = []
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "-m"):
            if i + 1 >= len(argv):
                raise UnsupportedCommand(f"argument expected for the {arg} option")
            return Command(arg[1], argv[i + 1], tuple(argv[i + 2 :]), frozenset(flags), tuple(warn_options),
                           tuple(argv))
        if arg.startswith("-W"):
            value = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else None)
            if value is None:
                raise UnsupportedCommand("argument expected for the -W option")
            warn_options.append(value)
            i += 1 if arg[2:] else 2
            continue
        if arg.startswith("-c") or arg.startswith("-m"):  # -cCODE, -mMODULE
            return Command(arg[1], arg[2:], tuple(argv[i + 1 :]), frozenset(flags), tuple(warn_options),
                           tuple(argv))
        if arg == "-" or not arg.startswith("-"):
            mode = "stdin" if arg == "-" else "script"
            return Command(mode, arg, tuple(argv[i + 1 :]), frozenset(flags), tuple(warn_options), tuple(argv))
        if arg == "--":
            i += 1
            continue
        if set(arg[1:]) <= _FLAGS:
            flags.update(arg[1:])
            i += 1
            continue
        raise UnsupportedCommand(
            f"option {arg!r} cannot be honoured by a warm command (supported: -c, -m, a script, -, "
            f"-u, -B, -E, -s, -q, -W); run it without warm"
        )
    return Command("stdin", "-", (), frozenset(flags), tuple(warn_options), tuple(argv))


@dataclasses.dataclass
class FreshState:
    """What a freshly started interpreter looked like, captured in the template before any warm-up."""

    handlers: dict[int, Any]
    warning_filters: list[Any]
    base_path: list[str]
    stdio: list[tuple[str, str]]
    dont_write_bytecode: bool

    @classmethod
    def capture(cls) -> FreshState:
        handlers = {}
        for sig in signal.valid_signals():
            try:
                handler = signal.getsignal(sig)
            except (OSError, ValueError):
                continue
            if handler is not None:
                handlers[sig] = handler
        own_path = set(os.environ.get("PYTHONPATH", "").split(os.pathsep)) - {""}
        base = [p for p in sys.path[1:] if p not in own_path]
        stdio = [(getattr(s, "encoding", None) or "utf-8", getattr(s, "errors", None) or "strict")
                 for s in (sys.__stdin__, sys.__stdout__, sys.__stderr__)]
        return cls(handlers, list(warnings.filters), base, stdio, sys.dont_write_bytecode)


def run(fresh: FreshState, spec: dict[str, Any], fds: list[int]) -> int:
    """In the forked child: become the command, run it, and return (or die with) its exit status."""
    command = parse_argv(spec["argv"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    identity = spec.get("identity")
    if identity:
        os.setgroups(identity["groups"])
        os.setgid(identity["gid"])
        os.setuid(identity["uid"])
    if spec.get("cwd"):
        os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    time.tzset()
    env = {} if "E" in command.flags else {k: os.environ[k] for k in HONOURED_ENV if os.environ.get(k)}
    _reset_process_state(fresh, command, env)
    interrupted = False
    try:
        _run_main(command)
        code = 0
    except SystemExit as exc:
        code = _system_exit_code(exc)
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # the traceback starts where a fresh interpreter's would
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code = 1
    code = _finalize(code)
    if interrupted:  # CPython ≥ 3.8 dies by SIGINT, so callers see the interrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _reset_process_state(fresh: FreshState, command: Command, env: dict[str, str]) -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig, handler in fresh.handlers.items():
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError, RuntimeError):
            pass
    unbuffered = "u" in command.flags or bool(env.get("PYTHONUNBUFFERED"))
    streams = [_text_stream(fd, encoding, errors, unbuffered) for fd, (encoding, errors) in enumerate(fresh.stdio)]
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams  # type: ignore[misc]
    warnings.filters[:] = fresh.warning_filters
    warnings._filters_mutated()  # type: ignore[attr-defined]
    for option in [*env.get("PYTHONWARNINGS", "").split(","), *command.warn_options]:
        if option:
            warnings._setoption(option)  # type: ignore[attr-defined]
    sys.dont_write_bytecode = fresh.dont_write_bytecode or "B" in command.flags or bool(
        env.get("PYTHONDONTWRITEBYTECODE"))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if command.mode == "m":
        first = [os.getcwd()]
    elif command.mode == "script":
        first = [os.path.dirname(os.path.realpath(command.target))]
    else:
        first = [""]
    if env.get("PYTHONSAFEPATH"):
        first = []
    sys.path[:] = [*first, *extra, *fresh.base_path]
    for entry in (*first, *extra, os.getcwd()):
        sys.path_importer_cache.pop(entry, None)
    sys.argv = ["-c" if command.mode == "c" else "-m" if command.mode == "m" else command.target, *command.args]
    sys.orig_argv = list(command.argv)


def _text_stream(fd: int, encoding: str, errors: str, unbuffered: bool) -> io.TextIOWrapper:
    """A standard stream built the way CPython builds it at startup."""
    reading = fd == 0
    raw = io.FileIO(fd, "r" if reading else "w", closefd=False)
    buffer: Any = io.BufferedReader(raw) if reading else raw if unbuffered else io.BufferedWriter(raw)
    line_buffering = fd == 2 or (fd == 1 and raw.isatty())
    stream = io.TextIOWrapper(buffer, encoding, "backslashreplace" if fd == 2 else errors,
                              line_buffering=line_buffering and not unbuffered, write_through=unbuffered)
    stream.mode = "r" if reading else "w"  # type: ignore[misc]
    return stream


def _fresh_main() -> dict[str, Any]:
    module = type(sys)("__main__")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    return module.__dict__


def _run_main(command: Command) -> None:
    namespace = _fresh_main()
    if command.mode == "m":
        runpy._run_module_as_main(command.target, alter_argv=True)  # type: ignore[attr-defined]
        return
    if command.mode == "script" and os.path.isdir(command.target):
        sys.path[0] = command.target
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    if command.mode == "script":
        try:
            with open(command.target, "rb") as f:
                source = f.read()
        except OSError as exc:
            print(f"{sys.executable}: can't open file {command.target!r}: [Errno {exc.errno}] {exc.strerror}",
                  file=sys.stderr)
            raise SystemExit(2) from None
        namespace.update(__file__=command.target, __cached__=None)
        filename = command.target
    elif command.mode == "stdin":
        source, filename = sys.stdin.buffer.read(), "<stdin>"
    else:
        source, filename = command.target, "<string>"
    exec(compile(source, filename, "exec"), namespace)


def _system_exit_code(exc: SystemExit) -> int:
    """CPython's handle_system_exit: None is 0, an int is itself, anything else is printed, 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _finalize(code: int) -> int:
    """Py_FinalizeEx's order: join non-daemon threads, atexit handlers, flush stdout and stderr."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:
            if stream is sys.stdout:
                code = 120
    return code
