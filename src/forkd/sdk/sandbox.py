"""``forkd.Sandbox``: E2B's ``Sandbox`` interface over forkd, so E2B code runs by changing the import.

Where E2B and forkd mean the same thing the names, parameters and return types are E2B's
(``Sandbox.create``, ``commands.run``, ``files.write``, ``run_code`` → ``Execution``); forkd adds
``eval``, ``branch`` and ``fork``. Everything goes through the daemon's REST API (``Controller``):
a ``ConnectionConfig`` (default: ``FORKD_URL``, ``FORKD_TOKEN``, ``FORKD_CA_CERT``) picks the daemon,
``FORKD_TEMPLATE`` the default snapshot.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

from forkd.errors import Failure
from forkd.sdk.commands import Commands
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.controller import Controller
from forkd.sdk.errors import ForkdError, InvalidArgumentException, NotFoundException, error_for
from forkd.sdk.filesystem import Filesystem
from forkd.sdk.models import (
    CodeError,
    Context,
    Execution,
    ExecutionError,
    ForkOutcome,
    Logs,
    OutputMessage,
    Result,
    SandboxInfo,
)

DEFAULT_TEMPLATE = "quickstart"  # the snapshot `forkd quickstart` bakes
DEFAULT_SANDBOX_TIMEOUT_S = 300  # as E2B: a forgotten sandbox does not live forever


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


class Sandbox:
    """One forkd child VM. ``Sandbox.create()`` forks it from a warm snapshot in well under a second."""

    def __init__(self, template: str | None = None, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S,
                 metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
                 url: str | None = None, token: str | None = None, connection: ConnectionConfig | None = None,
                 **_: Any) -> None:
        """Fork a sandbox from snapshot ``template`` (default ``$FORKD_TEMPLATE`` or ``quickstart``).

        ``Sandbox(...)`` is E2B v1's spelling of ``Sandbox.create(...)``; both work. The daemon kills
        the sandbox ``timeout`` seconds after it starts (``set_timeout`` renews; None = never).
        ``connection`` picks the daemon (default: the environment's); ``url``/``token`` override it.
        Unknown E2B keyword arguments (``api_key``, ``secure``…) are accepted and ignored.
        """
        controller = Controller(url=url, token=token, connection=connection)
        try:
            result = controller.fork(template or default_template(), 1, timeout_s=timeout, envs=envs,
                                     metadata=metadata)
            self._bind(_first_child(result), controller)
        except BaseException:
            controller.close()
            raise

    def _bind(self, sandbox_id: str, controller: Controller) -> None:
        self.sandbox_id = sandbox_id
        self._controller = controller
        self.commands = Commands(self)
        self.files = Filesystem(self)

    @property
    def api(self) -> Controller:
        """The REST client this sandbox talks through (``sandbox.commands`` and ``sandbox.files`` use it)."""
        return self._controller

    # lifecycle

    @classmethod
    def create(cls, template: str | None = None, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S,
               metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
               url: str | None = None, token: str | None = None, connection: ConnectionConfig | None = None,
               **kwargs: Any) -> Sandbox:
        """Fork a new sandbox (see the class); E2B v2's way to make one."""
        return cls(template, timeout, metadata, envs, url, token, connection, **kwargs)

    @classmethod
    def connect(cls, sandbox_id: str, url: str | None = None, token: str | None = None,
                connection: ConnectionConfig | None = None, **_: Any) -> Sandbox:
        """Attach to a running sandbox (``NotFoundException`` if there is none with that id)."""
        sandbox = cls._attach(sandbox_id, ConnectionConfig.resolve(connection, url, token))
        try:
            sandbox._controller.sandbox(sandbox_id)
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    @classmethod
    def _attach(cls, sandbox_id: str, connection: ConnectionConfig | None = None) -> Sandbox:
        """A handle on a sandbox by id, without asking the daemon anything."""
        sandbox = cls.__new__(cls)
        sandbox._bind(sandbox_id, Controller(connection=connection))
        return sandbox

    @classmethod
    def list(cls, url: str | None = None, token: str | None = None, connection: ConnectionConfig | None = None,
             **_: Any) -> list[SandboxInfo]:
        with Controller(url=url, token=token, connection=connection) as controller:
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
        _check_python(language)
        logs = Logs()

        def on_event(event: dict[str, Any]) -> None:
            if (output := _output_message(event, logs)) is not None:
                callback = on_stderr if output.error else on_stdout
                if callback is not None:
                    callback(output)

        outcome = self._controller.run_code(self.sandbox_id, _cell(code, envs), context=_context_name(context),
                                            timeout_s=timeout, on_event=on_event)
        execution = _execution(outcome, logs)
        for result in execution.results:
            if on_result is not None:
                on_result(result)
        if execution.error is not None and on_error is not None:
            on_error(execution.error)
        return execution

    def create_code_context(self, cwd: str | None = None, language: str | None = None,
                            request_timeout: float | None = None) -> Context:
        """A new context: its own interpreter process, forked from the snapshot's warm one."""
        del request_timeout
        _check_python(language)
        return Context.from_agent(self._controller.create_context(self.sandbox_id, cwd=cwd))

    def list_code_contexts(self) -> list[Context]:
        return [Context.from_agent(c) for c in self._controller.contexts(self.sandbox_id)]

    def restart_code_context(self, context: Context | str) -> None:
        """Back to a fresh fork of the warm interpreter (its variables are gone)."""
        self._controller.restart_context(self.sandbox_id, _context_name(context))

    def remove_code_context(self, context: Context | str) -> None:
        self._controller.remove_context(self.sandbox_id, _context_name(context))

    def eval(self, expr: str, context: Any = None) -> Any:
        """The value of one Python expression (JSON-able values as themselves, others as their repr)."""
        return _value(self._controller.eval(self.sandbox_id, expr, context=_context_name(context)))

    # forking

    def branch(self, tag: str | None = None, mode: Literal["full", "diff", "live"] = "diff",
               wait: bool = True) -> dict[str, Any]:
        """Snapshot this running sandbox as ``tag`` (it keeps running); children fork from the tag."""
        return self._controller.branch(self.sandbox_id, tag=tag or _branch_tag(self.sandbox_id), mode=mode,
                                       wait=wait)

    def fork(self, count: int = 1, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S) -> list[Sandbox]:
        """``count`` new sandboxes in this one's exact current state (a BRANCH, then forks of it).

        If any child fails the others are killed and ``ForkFailed`` says which failed and why.
        """
        tag = self.branch(mode="diff")["tag"]
        outcome = ForkOutcome.from_children(list(self._controller.fork_iter(tag, count, timeout_s=timeout)))
        for sandbox_id in outcome.to_kill():
            with contextlib.suppress(ForkdError):
                self._controller.kill(sandbox_id)
        return [Sandbox._attach(sandbox_id, self._controller.connection) for sandbox_id in outcome.sandbox_ids()]


def _first_child(result: dict[str, Any]) -> str:
    """The one sandbox a create started, or its child's error raised as that error's own class."""
    if not result["sandboxes"]:
        if not result["errors"]:
            raise ForkdError(500, "fork_failed", "the daemon started no sandbox")
        failure = Failure.from_answer(result["errors"][0])
        raise error_for(failure.kind.status, failure.code, f"the sandbox did not start: {failure}")
    return result["sandboxes"][0]["id"]


def _context_name(context: Any) -> str:
    """E2B passes ``Context`` objects (with ``.id``); forkd's contexts are names."""
    if context is None:
        return "default"
    return str(getattr(context, "id", context))


def _check_python(language: str | None) -> None:
    if language not in (None, "python", "py"):
        raise InvalidArgumentException(400, "invalid_request", f"forkd runs Python cells, not {language!r}")


def _cell(code: str, envs: dict[str, str] | None) -> str:
    """E2B's per-cell ``envs``, set in the interpreter before the cell runs."""
    if not envs:
        return code
    return f"import os as _forkd_os\n_forkd_os.environ.update({dict(envs)!r})\n" + code


def _output_message(event: dict[str, Any], logs: Logs) -> OutputMessage | None:
    """A cell's output event as an ``OutputMessage``, kept in ``logs``; None for other events."""
    name = event.get("event")
    if name not in ("stdout", "stderr"):
        return None
    message = OutputMessage(line=event.get("data", ""), timestamp=time.time_ns(), error=name == "stderr")
    getattr(logs, name).append(message.line)
    return message


def _value(outcome: dict[str, Any]) -> Any:
    """An ``eval`` answer's value; raises ``CodeError`` if the expression raised."""
    if outcome.get("error"):
        raise CodeError(ExecutionError.from_agent(outcome["error"]))
    return outcome["value_json"] if outcome.get("value_json") is not None else outcome.get("value")


def _branch_tag(sandbox_id: str) -> str:
    return f"{sandbox_id}-{secrets.token_hex(4)}"


def _execution(outcome: dict[str, Any], logs: Logs) -> Execution:
    error = outcome.get("error")
    if "results" in outcome:
        results = [Result.from_agent(result) for result in outcome["results"]]
        for result in results:  # the value itself, as before rich results, unless it has a _repr_json_
            if result.is_main_result and result.json is None:
                result.json = outcome.get("value_json")
    else:  # a daemon or guest from before rich results
        results = [] if outcome.get("value") is None else [Result(text=outcome["value"], json=outcome.get("value_json"))]
    return Execution(results=results, logs=logs, error=ExecutionError.from_agent(error) if error else None)
