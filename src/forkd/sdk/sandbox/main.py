"""The sandbox, written once for ``forkd.Sandbox`` and ``forkd.AsyncSandbox``: E2B's interface over forkd.

Where E2B and forkd mean the same thing the names, parameters and return types are E2B's
(``Sandbox.create``, ``commands.run``, ``files.write``, ``run_code`` → ``Execution``); forkd adds
``eval``, ``branch`` and ``fork``. Everything goes through the daemon's REST API (a ``Controller`` or
``AsyncController``): a ``ConnectionConfig`` (default: ``FORKD_URL``, ``FORKD_TOKEN``,
``FORKD_CA_CERT``) picks the daemon, ``FORKD_TEMPLATE`` the default snapshot. Each method is a step
generator (``flavour.py``); ``sandbox_sync`` and ``sandbox_async`` add the client class, how to
wait, and their own construction and ``with`` forms.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

from forkd.errors import Failure
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.errors import ForkdError, InvalidArgumentException, error_for
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
from forkd.sdk.sandbox.commands import CommandsCore
from forkd.sdk.sandbox.filesystem import FilesystemCore
from forkd.sdk.sandbox.flavour import Flavour, Steps, found, operation
from forkd.sdk.sandbox.options import FORK_LIMITS, ConnectOptions, CreateOptions, check_keywords, network
from forkd.sdk.retry import busy_pauses

DEFAULT_TEMPLATE = "quickstart"  # the snapshot `forkd quickstart` bakes
DEFAULT_SANDBOX_TIMEOUT_S = 300  # as E2B: a forgotten sandbox does not live forever


def default_template() -> str:
    return os.environ.get("FORKD_TEMPLATE", DEFAULT_TEMPLATE)


class SandboxCore:
    """One forkd child VM. ``create()`` forks it from a warm snapshot in well under a second."""

    _flavour: Flavour
    _client: Callable[..., Any]  # Controller or AsyncController
    _commands: type[CommandsCore]
    _files: type[FilesystemCore]

    def _bind(self, sandbox_id: str, api: Any) -> None:
        self.sandbox_id = sandbox_id
        self._api = api
        self.commands = self._commands(self)
        self.files = self._files(self)

    @property
    def api(self) -> Any:
        """The REST client this sandbox talks through (``sandbox.commands`` and ``sandbox.files`` use it)."""
        return self._api

    @classmethod
    def _on(cls, sandbox_id: str, api: Any) -> Any:
        """A handle on a sandbox by id through ``api``, without asking the daemon anything."""
        sandbox = cls.__new__(cls)
        sandbox._bind(sandbox_id, api)
        return sandbox

    @classmethod
    def _attach(cls, sandbox_id: str, connection: ConnectionConfig | None = None) -> Any:
        """A handle on a sandbox by id, with a client of its own."""
        return cls._on(sandbox_id, cls._client(connection=connection))

    # lifecycle

    @classmethod
    def create(cls, template: str | None = None, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S,
               metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None, **options: Any) -> Any:
        """Fork a sandbox from snapshot ``template`` (default ``$FORKD_TEMPLATE`` or ``quickstart``).

        The daemon kills the sandbox ``timeout`` seconds after it starts (``set_timeout`` renews; None =
        never). ``envs`` is every command's default environment, ``metadata`` labels kept with it. The sandbox
        has no network unless ``net="nat"`` (E2B's ``allow_internet_access=True`` means the same), then
        ``egress`` filters where it may connect; ``memory_limit_mib``, ``cpu_quota``, ``cpu_weight`` and
        ``pids_max`` bound its VMM. ``connection`` picks the daemon (default: the environment's);
        ``url``/``token``/``request_timeout`` override it. E2B's ``api_key``, ``domain``, ``debug``, ``secure``,
        ``proxy`` and ``headers`` are accepted and ignored; any other keyword raises ``TypeError``.
        A ``busy`` daemon (at ``max_sandboxes``) is asked again, backing off, before ``RateLimitException``.
        """
        check_keywords("create", options, CreateOptions)
        fork_options = {name: options.get(name) for name in FORK_LIMITS}
        fork_options["net"] = network(options.get("net"), options.get("allow_internet_access"))
        api = cls._client(url=options.get("url"), token=options.get("token"), timeout=options.get("request_timeout"),
                          connection=options.get("connection"))
        return cls._flavour.run(cls._create(api, template or default_template(),
                                            dict(timeout_s=timeout, envs=envs, metadata=metadata, **fork_options)))

    @classmethod
    def _create(cls, api: Any, template: str, fork_options: dict[str, Any]) -> Steps[Any]:
        try:
            pauses = busy_pauses()
            while _refused_busy(result := (yield api.fork(template, 1, **fork_options))) and \
                    (pause := next(pauses)) is not None:
                yield cls._flavour.sleep(pause)
            return cls._on(_first_child(result), api)
        except BaseException:
            yield api.close()
            raise

    @classmethod
    def connect(cls, sandbox_id: str, **options: Any) -> Any:
        """Attach to a running sandbox (``NotFoundException`` if there is none with that id); ``options`` are
        ``connection``, ``url``, ``token``, ``request_timeout`` and E2B's ignored ones, as for ``create``."""
        sandbox = cls._on(sandbox_id, _client_for(cls, "connect", options))
        return cls._flavour.run(sandbox._checked())

    def _checked(self) -> Steps[Any]:
        try:
            yield self._api.sandbox(self.sandbox_id)
        except BaseException:
            yield self._api.close()
            raise
        return self

    @classmethod
    def list(cls, **options: Any) -> Any:
        """Every running sandbox, as ``SandboxInfo``; ``options`` pick the daemon, as for ``connect``."""
        return cls._flavour.run(_listed(_client_for(cls, "list", options)))

    @operation
    def kill(self) -> Steps[bool]:
        """Stop the sandbox and free everything it held; ``False`` if it was not running."""
        return (yield from found(self._api.kill, self.sandbox_id))

    @operation
    def set_timeout(self, timeout: float) -> Steps[None]:
        """The daemon kills the sandbox ``timeout`` seconds from now."""
        yield self._api.set_timeout(self.sandbox_id, timeout)

    @operation
    def get_info(self) -> Steps[SandboxInfo]:
        """The sandbox's ``SandboxInfo``: id, template, metadata, when it started and when the daemon ends it."""
        return SandboxInfo.from_daemon((yield self._api.sandbox(self.sandbox_id)))

    @operation
    def is_running(self) -> Steps[bool]:
        """Whether the sandbox answers. ``False`` once it ended, including the moment its VM is being
        stopped, when the daemon still finds it but answers that its guest agent is gone."""
        try:
            yield self._api.ping(self.sandbox_id)
        except ForkdError as exc:
            if exc.code in ("not_found", "sandbox_ended", "agent_unavailable"):
                return False
            raise
        return True

    def close(self) -> Any:
        """Close the connection to the daemon (the sandbox keeps running)."""
        return self._api.close()

    @operation
    def _leave(self) -> Steps[None]:
        """What leaving ``with`` does: kill the sandbox, then close the connection."""
        try:
            yield from SandboxCore.kill.steps(self)
        finally:
            yield self.close()

    # code

    @operation
    def run_code(self, code: str, language: str | None = None, context: Any = None,
                 on_stdout: Callable[[OutputMessage], Any] | None = None,
                 on_stderr: Callable[[OutputMessage], Any] | None = None,
                 on_result: Callable[[Result], Any] | None = None,
                 on_error: Callable[[ExecutionError], Any] | None = None,
                 envs: dict[str, str] | None = None, timeout: float | None = None,
                 request_timeout: float | None = None) -> Steps[Execution]:
        """Run a Python cell in a persistent context (state survives between calls), Jupyter-style.
        The async flavour's callbacks may be coroutine functions."""
        del request_timeout
        _check_python(language)
        logs = Logs()

        def on_event(event: dict[str, Any]) -> Any:  # the client calls it (and awaits it, if async)
            if (output := _output_message(event, logs)) is not None:
                callback = on_stderr if output.error else on_stdout
                if callback is not None:
                    return callback(output)
            return None

        outcome = yield self._api.run_code(self.sandbox_id, _cell(code, envs), context=_context_name(context),
                                           timeout_s=timeout, on_event=on_event)
        execution = _execution(outcome, logs)
        for result in execution.results:
            if on_result is not None:
                yield on_result(result)
        if execution.error is not None and on_error is not None:
            yield on_error(execution.error)
        return execution

    @operation
    def create_code_context(self, cwd: str | None = None, language: str | None = None,
                            request_timeout: float | None = None) -> Steps[Context]:
        """A new context: its own interpreter process, forked from the snapshot's warm one."""
        del request_timeout
        _check_python(language)
        return Context.from_agent((yield self._api.create_context(self.sandbox_id, cwd=cwd)))

    @operation
    def list_code_contexts(self) -> Steps[builtins.list[Context]]:
        """Every code context of the sandbox (``default`` once a cell ran in it)."""
        return [Context.from_agent(c) for c in (yield self._api.contexts(self.sandbox_id))]

    @operation
    def restart_code_context(self, context: Context | str) -> Steps[None]:
        """Back to a fresh fork of the warm interpreter (its variables are gone)."""
        yield self._api.restart_context(self.sandbox_id, _context_name(context))

    @operation
    def remove_code_context(self, context: Context | str) -> Steps[None]:
        """End the context's interpreter; its variables are gone."""
        yield self._api.remove_context(self.sandbox_id, _context_name(context))

    @operation
    def eval(self, expr: str, context: Any = None) -> Steps[Any]:
        """The value of one Python expression (JSON-able values as themselves, others as their repr)."""
        return _value((yield self._api.eval(self.sandbox_id, expr, context=_context_name(context))))

    # forking

    @operation
    def branch(self, tag: str | None = None, mode: Literal["full", "diff", "live"] = "diff",
               wait: bool = True) -> Steps[dict[str, Any]]:
        """Snapshot this running sandbox as ``tag`` (it keeps running); children fork from the tag."""
        snapshot: dict[str, Any] = yield self._api.branch(self.sandbox_id, tag=tag or _branch_tag(self.sandbox_id),
                                                          mode=mode, wait=wait)
        return snapshot

    @operation
    def fork(self, count: int = 1, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S) -> Steps[builtins.list[Any]]:
        """``count`` new sandboxes in this one's exact current state (a BRANCH, then forks of it).

        If any child fails the others are killed and ``ForkFailed`` says which failed and why.
        """
        tag = (yield from SandboxCore.branch.steps(self, mode="diff"))["tag"]
        children = yield self._flavour.collect(self._api.fork_iter(tag, count, timeout_s=timeout))
        outcome = ForkOutcome.from_children(children)
        for sandbox_id in outcome.to_kill():
            with contextlib.suppress(ForkdError):
                yield self._api.kill(sandbox_id)
        return [self._attach(sandbox_id, self._api.connection) for sandbox_id in outcome.sandbox_ids()]


def _client_for(cls: type[SandboxCore], function: str, options: dict[str, Any]) -> Any:
    """The client ``connect``/``list`` talk through: ``options`` checked (``TypeError`` for an unknown one)."""
    check_keywords(function, options, ConnectOptions)
    return cls._client(url=options.get("url"), token=options.get("token"), timeout=options.get("request_timeout"),
                       connection=options.get("connection"))


def _refused_busy(result: dict[str, Any]) -> bool:
    """Whether a one-child fork was refused because the daemon is at its ``max_sandboxes``."""
    return not result["sandboxes"] and bool(result["errors"]) and Failure.from_answer(result["errors"][0]).code == "busy"


def _listed(api: Any) -> Steps[builtins.list[SandboxInfo]]:
    try:
        return [SandboxInfo.from_daemon(s) for s in (yield api.sandboxes())]
    finally:
        yield api.close()


def _first_child(result: dict[str, Any]) -> str:
    """The one sandbox a create started, or its child's error raised as that error's own class."""
    if not result["sandboxes"]:
        if not result["errors"]:
            raise ForkdError(500, "fork_failed", "the daemon started no sandbox")
        failure = Failure.from_answer(result["errors"][0])
        raise error_for(failure.kind.status, failure.code, f"the sandbox did not start: {failure}")
    return str(result["sandboxes"][0]["id"])


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
