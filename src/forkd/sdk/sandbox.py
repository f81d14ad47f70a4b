"""``forkd.Sandbox``: E2B's ``Sandbox`` interface over forkd, so E2B code runs by changing the import.

Where E2B and forkd mean the same thing the names, parameters and return types are E2B's
(``Sandbox.create``, ``commands.run``, ``files.write``, ``run_code`` → ``Execution``); forkd adds
``eval``, ``branch`` and ``fork``. Everything goes through the daemon's REST API (``Controller``):
``FORKD_URL`` and ``FORKD_TOKEN`` pick the daemon, ``FORKD_TEMPLATE`` the default snapshot.
"""

from __future__ import annotations

import functools
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, Literal

from forkd.sdk.controller import Controller, EventStream
from forkd.sdk.errors import ForkdError, InvalidArgumentException, NotFoundException, TimeoutException
from forkd.sdk.models import (
    CodeError,
    CommandExitException,
    CommandResult,
    EntryInfo,
    Execution,
    ExecutionError,
    Logs,
    OutputMessage,
    ProcessInfo,
    Result,
    SandboxInfo,
    WriteEntry,
    WriteInfo,
)

DEFAULT_TEMPLATE = "quickstart"  # the snapshot `forkd quickstart` bakes
DEFAULT_SANDBOX_TIMEOUT_S = 300  # as E2B: a forgotten sandbox does not live forever
UPLOAD_PIECE_BYTES = 1 << 20


def default_template() -> str:
    return os.environ.get("FORKD_TEMPLATE", DEFAULT_TEMPLATE)


class class_or_instance:  # noqa: N801 - used like the decorators it stands beside
    """``Sandbox.kill(id)`` and ``sandbox.kill()`` both work, as in E2B."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(self, instance: Any, owner: type) -> Callable[..., Any]:
        if instance is not None:
            return functools.partial(self.method, instance)

        def on_class(sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
            sandbox = owner._attach(sandbox_id)
            try:
                return self.method(sandbox, *args, **kwargs)
            finally:
                sandbox.close()

        return on_class


class CommandHandle:
    """A command started in the background: its ``pid``, ``wait()``, ``kill()``, ``send_stdin()``."""

    def __init__(self, sandbox: Sandbox, events: EventStream) -> None:
        self._sandbox = sandbox
        self._events = events
        self._iterator = iter(events)
        first = next(self._iterator, None)
        if first is None or first.get("event") != "started":
            events.close()
            raise ForkdError(500, "no_start", f"the command did not report a start: {first or events.result}")
        self.pid: int = first["pid"]
        self._stdout: list[str] = []
        self._stderr: list[str] = []

    def __iter__(self) -> Iterator[tuple[str | None, str | None, None]]:
        """``(stdout, stderr, pty)`` pieces as they arrive, one set, as E2B's handle yields them."""
        for event in self._iterator:
            name, data = event.get("event"), event.get("data", "")
            if name == "stdout":
                self._stdout.append(data)
                yield data, None, None
            elif name == "stderr":
                self._stderr.append(data)
                yield None, data, None

    def wait(self, on_stdout: Callable[[str], Any] | None = None,
             on_stderr: Callable[[str], Any] | None = None) -> CommandResult:
        """Block until the command ends; raises ``CommandExitException`` if it exits non-zero."""
        for stdout, stderr, _ in self:
            if stdout is not None and on_stdout is not None:
                on_stdout(stdout)
            if stderr is not None and on_stderr is not None:
                on_stderr(stderr)
        outcome = self._events.result or {}
        if outcome.get("timed_out"):
            raise TimeoutException(504, "timeout", f"command {self.pid} ran past its timeout and was killed")
        result = CommandResult(stdout="".join(self._stdout), stderr="".join(self._stderr),
                               exit_code=outcome.get("exit_code", -1), error=_signal_error(outcome))
        if result.exit_code != 0:
            raise CommandExitException(result)
        return result

    def kill(self) -> bool:
        """SIGKILL the command's process group; ``False`` if it had already ended."""
        return self._sandbox.commands.kill(self.pid)

    def send_stdin(self, data: str) -> None:
        self._sandbox.commands.send_stdin(self.pid, data)

    def disconnect(self) -> None:
        """Stop reading its output; the command keeps running (kill it with ``commands.kill(pid)``)."""
        self._events.close()


def _signal_error(outcome: dict[str, Any]) -> str | None:
    return f"killed by signal {outcome['signal']}" if outcome.get("signal") else None


class Commands:
    """``sandbox.commands``: run shell commands (``/bin/sh -c``) in the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def run(self, cmd: str, background: bool | None = None, envs: dict[str, str] | None = None,
            user: str | None = None, cwd: str | None = None, on_stdout: Callable[[str], Any] | None = None,
            on_stderr: Callable[[str], Any] | None = None, stdin: bool | str | None = None,
            timeout: float | None = 60, request_timeout: float | None = None,
            warm: bool = False) -> CommandResult | CommandHandle:
        """Run ``cmd``; wait and return a ``CommandResult``, or with ``background=True`` a ``CommandHandle``.

        ``stdin=True`` keeps stdin open for ``send_stdin``; a string is written to stdin, which is then
        closed; by default stdin is empty. ``timeout`` (seconds, 0 = none) kills the command's process group.
        ``warm=True`` (forkd): ``cmd`` is a ``python3 ...`` command line, run as a fork of the snapshot's
        warm interpreter so its imports are already done (see docs/guest-protocol.md for the differences).
        """
        del request_timeout  # requests are bounded by the command's own timeout
        handle = CommandHandle(self._sandbox, self._sandbox._controller.start_exec(
            self._sandbox.sandbox_id, cmd, env=envs, cwd=cwd, user=user, timeout_s=timeout or None,
            stdin=None if stdin is True else (stdin or ""), warm=warm))
        if background:
            return handle
        return handle.wait(on_stdout=on_stdout, on_stderr=on_stderr)

    def kill(self, pid: int) -> bool:
        try:
            self._sandbox._controller.signal_process(self._sandbox.sandbox_id, pid, 9)
        except NotFoundException:
            return False
        return True

    def send_stdin(self, pid: int, data: str) -> None:
        self._sandbox._controller.send_stdin(self._sandbox.sandbox_id, pid, data)

    def close_stdin(self, pid: int) -> None:
        self._sandbox._controller.send_stdin(self._sandbox.sandbox_id, pid, "", eof=True)

    def list(self) -> list[ProcessInfo]:
        """Running commands and the last finished ones."""
        return [ProcessInfo(pid=p["pid"], cmd=p.get("shell") or " ".join(p.get("argv", [])),
                            args=list(p.get("argv", [])), running=p["running"], exit_code=p["exit_code"],
                            started_at=p.get("started_at"))
                for p in self._sandbox._controller.processes(self._sandbox.sandbox_id)]


class Filesystem:
    """``sandbox.files``: read, write and manage files inside the sandbox (binary-safe, any size)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    @property
    def _api(self) -> Controller:
        return self._sandbox._controller

    @property
    def _id(self) -> str:
        return self._sandbox.sandbox_id

    def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text",
             request_timeout: float | None = None) -> str | bytearray | Iterator[bytes]:
        del request_timeout
        if format == "stream":
            return self._api.read_file_chunks(self._id, path)
        data = self._api.read_file(self._id, path)
        if format == "bytes":
            return bytearray(data)
        if format == "text":
            return data.decode()
        raise InvalidArgumentException(400, "invalid_request", f"format must be text, bytes or stream, not {format!r}")

    def write(self, path: str, data: str | bytes | IO[Any] | list[WriteEntry] | list[dict[str, Any]],
              request_timeout: float | None = None) -> WriteInfo | list[WriteInfo]:
        """Write one file (``str``, ``bytes`` or a file object, streamed), or a list of entries."""
        del request_timeout
        if isinstance(data, list):
            return self.write_files(data)
        self._api.write_file(self._id, path, _pieces(data))
        return WriteInfo(name=os.path.basename(path), path=path)

    def write_files(self, files: Iterable[WriteEntry | dict[str, Any]]) -> list[WriteInfo]:
        entries = [f if isinstance(f, WriteEntry) else WriteEntry(path=f["path"], data=f["data"]) for f in files]
        return [self.write(e.path, e.data) for e in entries]  # type: ignore[misc]

    def list(self, path: str, depth: int = 1) -> list[EntryInfo]:
        """Entries under ``path``, descending ``depth`` levels (1 = just its children)."""
        if depth < 1:
            raise InvalidArgumentException(400, "invalid_request", "depth must be at least 1")
        found = []
        for entry in map(EntryInfo.from_agent, self._api.list_files(self._id, path)):
            found.append(entry)
            if depth > 1 and entry.type.value == "dir":
                found.extend(self.list(entry.path, depth - 1))
        return found

    def exists(self, path: str) -> bool:
        try:
            self._api.stat(self._id, path)
        except NotFoundException:
            return False
        return True

    def get_info(self, path: str) -> EntryInfo:
        return EntryInfo.from_agent(self._api.stat(self._id, path))

    def remove(self, path: str) -> None:
        """Remove a file, or a directory with everything in it."""
        self._api.remove_file(self._id, path, recursive=True)

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        self._api.rename(self._id, old_path, new_path)
        return self.get_info(new_path)

    def make_dir(self, path: str) -> bool:
        """Create ``path`` and its parents; ``False`` if it already existed."""
        if self.exists(path):
            return False
        self._api.make_dir(self._id, path)
        return True


def _pieces(data: str | bytes | IO[Any]) -> bytes | Iterator[bytes]:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)

    def read_all() -> Iterator[bytes]:
        while piece := data.read(UPLOAD_PIECE_BYTES):
            yield piece.encode() if isinstance(piece, str) else piece

    return read_all()


class Sandbox:
    """One forkd child VM. ``Sandbox.create()`` forks it from a warm snapshot in well under a second."""

    def __init__(self, template: str | None = None, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S,
                 metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
                 url: str | None = None, token: str | None = None, **_: Any) -> None:
        """Fork a sandbox from snapshot ``template`` (default ``$FORKD_TEMPLATE`` or ``quickstart``).

        ``Sandbox(...)`` is E2B v1's spelling of ``Sandbox.create(...)``; both work. The daemon kills
        the sandbox ``timeout`` seconds after it starts (``set_timeout`` renews; None = never).
        Unknown E2B keyword arguments (``api_key``, ``secure``…) are accepted and ignored.
        """
        controller = Controller(url=url, token=token)
        try:
            result = controller.fork(template or default_template(), 1, timeout_s=timeout, envs=envs,
                                     metadata=metadata)
            self._bind(_first_child(result), controller, token)
        except BaseException:
            controller.close()
            raise

    def _bind(self, sandbox_id: str, controller: Controller, token: str | None) -> None:
        self.sandbox_id = sandbox_id
        self._controller = controller
        self._token = token
        self.commands = Commands(self)
        self.files = Filesystem(self)

    # lifecycle

    @classmethod
    def create(cls, template: str | None = None, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S,
               metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
               url: str | None = None, token: str | None = None, **kwargs: Any) -> Sandbox:
        """Fork a new sandbox (see the class); E2B v2's way to make one."""
        return cls(template, timeout, metadata, envs, url, token, **kwargs)

    @classmethod
    def connect(cls, sandbox_id: str, url: str | None = None, token: str | None = None, **_: Any) -> Sandbox:
        """Attach to a running sandbox (``NotFoundException`` if there is none with that id)."""
        sandbox = cls._attach(sandbox_id, url, token)
        try:
            sandbox._controller.sandbox(sandbox_id)
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    @classmethod
    def _attach(cls, sandbox_id: str, url: str | None = None, token: str | None = None) -> Sandbox:
        """A handle on a sandbox by id, without asking the daemon anything."""
        sandbox = cls.__new__(cls)
        sandbox._bind(sandbox_id, Controller(url=url, token=token), token)
        return sandbox

    @classmethod
    def list(cls, url: str | None = None, token: str | None = None, **_: Any) -> list[SandboxInfo]:
        with Controller(url=url, token=token) as controller:
            return [SandboxInfo.from_daemon(s) for s in controller.sandboxes()]

    @class_or_instance
    def kill(self) -> bool:
        """Stop the sandbox and free everything it held; ``False`` if it was not running."""
        try:
            self._controller.kill(self.sandbox_id)
        except NotFoundException:
            return False
        return True

    @class_or_instance
    def set_timeout(self, timeout: float) -> None:
        """The daemon kills the sandbox ``timeout`` seconds from now."""
        self._controller.set_timeout(self.sandbox_id, timeout)

    @class_or_instance
    def get_info(self) -> SandboxInfo:
        return SandboxInfo.from_daemon(self._controller.sandbox(self.sandbox_id))

    def is_running(self) -> bool:
        try:
            self._controller.ping(self.sandbox_id)
        except NotFoundException:
            return False
        return True

    def close(self) -> None:
        """Close the connection to the daemon (the sandbox keeps running)."""
        self._controller.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *_: object) -> None:
        try:
            self.kill()
        finally:
            self.close()

    # code

    def run_code(self, code: str, language: str | None = None, context: Any = None,
                 on_stdout: Callable[[OutputMessage], Any] | None = None,
                 on_stderr: Callable[[OutputMessage], Any] | None = None,
                 on_result: Callable[[Result], Any] | None = None,
                 on_error: Callable[[ExecutionError], Any] | None = None,
                 envs: dict[str, str] | None = None, timeout: float | None = None,
                 request_timeout: float | None = None) -> Execution:
        """Run a Python cell in a persistent context (state survives between calls), Jupyter-style."""
        del request_timeout
        if language not in (None, "python", "py"):
            raise InvalidArgumentException(400, "invalid_request", f"forkd runs Python cells, not {language!r}")
        if envs:
            code = f"import os as _forkd_os\n_forkd_os.environ.update({dict(envs)!r})\n" + code
        logs = Logs()

        def on_event(event: dict[str, Any]) -> None:
            name = event.get("event")
            if name not in ("stdout", "stderr"):
                return
            message = OutputMessage(line=event.get("data", ""), timestamp=time.time_ns(), error=name == "stderr")
            getattr(logs, name).append(message.line)
            callback = on_stdout if name == "stdout" else on_stderr
            if callback is not None:
                callback(message)

        outcome = self._controller.run_code(self.sandbox_id, code, context=_context_name(context),
                                            timeout_s=timeout, on_event=on_event)
        execution = _execution(outcome, logs)
        for result in execution.results:
            if on_result is not None:
                on_result(result)
        if execution.error is not None and on_error is not None:
            on_error(execution.error)
        return execution

    def eval(self, expr: str, context: Any = None) -> Any:
        """The value of one Python expression (JSON-able values as themselves, others as their repr)."""
        outcome = self._controller.eval(self.sandbox_id, expr, context=_context_name(context))
        if outcome.get("error"):
            raise CodeError(ExecutionError.from_agent(outcome["error"]))
        return outcome["value_json"] if outcome.get("value_json") is not None else outcome.get("value")

    # forking

    def branch(self, tag: str | None = None, mode: Literal["full", "diff", "live"] = "diff",
               wait: bool = True) -> dict[str, Any]:
        """Snapshot this running sandbox as ``tag`` (it keeps running); children fork from the tag."""
        return self._controller.branch(self.sandbox_id, tag=tag or _branch_tag(self.sandbox_id), mode=mode,
                                       wait=wait)

    def fork(self, count: int = 1, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S) -> list[Sandbox]:
        """``count`` new sandboxes in this one's exact current state (a BRANCH, then forks of it)."""
        tag = self.branch(mode="diff")["tag"]
        result = self._controller.fork(tag, count, timeout_s=timeout)
        children = [Sandbox._attach(child["id"], self._controller.url, self._token) for child in result["sandboxes"]]
        if result["errors"]:
            for child in children:
                child.kill()
                child.close()
            raise ForkdError(500, "fork_failed", "; ".join(result["errors"]))
        return children


def _first_child(result: dict[str, Any]) -> str:
    if not result["sandboxes"]:
        raise ForkdError(500, "fork_failed", "; ".join(result["errors"]) or "the daemon started no sandbox")
    return result["sandboxes"][0]["id"]


def _context_name(context: Any) -> str:
    """E2B passes ``Context`` objects (with ``.id``); forkd's contexts are names."""
    if context is None:
        return "default"
    return str(getattr(context, "id", context))


def _branch_tag(sandbox_id: str) -> str:
    return f"{sandbox_id}-{secrets.token_hex(4)}"


def _execution(outcome: dict[str, Any], logs: Logs) -> Execution:
    error = outcome.get("error")
    if "results" in outcome:
        results = [Result.from_agent(result) for result in outcome["results"]]
    else:  # a daemon or guest from before rich results
        results = [] if outcome.get("value") is None else [Result(text=outcome["value"], json=outcome.get("value_json"))]
    return Execution(results=results, logs=logs, error=ExecutionError.from_agent(error) if error else None)
