"""``forkd.AsyncSandbox``: ``Sandbox``'s interface for asyncio code (E2B's ``AsyncSandbox``), on ``httpx.AsyncClient``.

Every call is a coroutine on ``AsyncController``; nothing runs in worker threads and nothing blocks the
event loop. Callbacks may be plain functions or coroutine functions. The answers are read by the same
functions ``Sandbox`` uses, so the two interfaces cannot drift apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

from forkd.sdk.async_controller import AsyncController, maybe_await
from forkd.sdk.commands import AsyncCommands
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.errors import ForkdError, NotFoundException
from forkd.sdk.filesystem import AsyncFilesystem
from forkd.sdk.models import (
    Context,
    Execution,
    ExecutionError,
    ForkOutcome,
    Logs,
    OutputMessage,
    Result,
    SandboxInfo,
)
from forkd.sdk.sandbox import (
    DEFAULT_SANDBOX_TIMEOUT_S,
    _branch_tag,
    _cell,
    _check_python,
    _context_name,
    _execution,
    _first_child,
    _output_message,
    _value,
    default_template,
)


class AsyncSandbox:
    """``sbx = await AsyncSandbox.create()``; then ``await sbx.commands.run(...)`` and so on."""

    def __init__(self, sandbox_id: str, api: AsyncController) -> None:
        """A handle on sandbox ``sandbox_id`` through ``api`` (use ``create`` or ``connect`` to get one)."""
        self.sandbox_id = sandbox_id
        self._api = api
        self.commands = AsyncCommands(self)
        self.files = AsyncFilesystem(self)

    @property
    def api(self) -> AsyncController:
        """The REST client this sandbox talks through."""
        return self._api

    # lifecycle

    @classmethod
    async def create(cls, template: str | None = None, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S,
                     metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
                     url: str | None = None, token: str | None = None, connection: ConnectionConfig | None = None,
                     **_: Any) -> AsyncSandbox:
        """Fork a new sandbox, as ``Sandbox.create``."""
        api = AsyncController(url=url, token=token, connection=connection)
        try:
            result = await api.fork(template or default_template(), 1, timeout_s=timeout, envs=envs,
                                    metadata=metadata)
            return cls(_first_child(result), api)
        except BaseException:
            await api.close()
            raise

    @classmethod
    async def connect(cls, sandbox_id: str, url: str | None = None, token: str | None = None,
                      connection: ConnectionConfig | None = None, **_: Any) -> AsyncSandbox:
        """Attach to a running sandbox (``NotFoundException`` if there is none with that id)."""
        api = AsyncController(url=url, token=token, connection=connection)
        try:
            await api.sandbox(sandbox_id)
        except BaseException:
            await api.close()
            raise
        return cls(sandbox_id, api)

    @classmethod
    async def list(cls, url: str | None = None, token: str | None = None, connection: ConnectionConfig | None = None,
                   **_: Any) -> list[SandboxInfo]:
        async with AsyncController(url=url, token=token, connection=connection) as api:
            return [SandboxInfo.from_daemon(s) for s in await api.sandboxes()]

    async def kill(self) -> bool:
        """Stop the sandbox and free everything it held; ``False`` if it was not running."""
        try:
            await self._api.kill(self.sandbox_id)
        except NotFoundException:
            return False
        return True

    async def set_timeout(self, timeout: float) -> None:
        await self._api.set_timeout(self.sandbox_id, timeout)

    async def get_info(self) -> SandboxInfo:
        return SandboxInfo.from_daemon(await self._api.sandbox(self.sandbox_id))

    async def is_running(self) -> bool:
        try:
            await self._api.ping(self.sandbox_id)
        except NotFoundException:
            return False
        return True

    async def close(self) -> None:
        """Close the connection to the daemon (the sandbox keeps running)."""
        await self._api.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *_: object) -> None:
        try:
            await self.kill()
        finally:
            await self.close()

    # code

    async def run_code(self, code: str, language: str | None = None, context: Any = None,
                       on_stdout: Callable[[OutputMessage], Any] | None = None,
                       on_stderr: Callable[[OutputMessage], Any] | None = None,
                       on_result: Callable[[Result], Any] | None = None,
                       on_error: Callable[[ExecutionError], Any] | None = None,
                       envs: dict[str, str] | None = None, timeout: float | None = None,
                       request_timeout: float | None = None) -> Execution:
        """As ``Sandbox.run_code``; the callbacks may be coroutine functions."""
        del request_timeout
        _check_python(language)
        logs = Logs()

        async def on_event(event: dict[str, Any]) -> None:
            if (output := _output_message(event, logs)) is not None:
                callback = on_stderr if output.error else on_stdout
                if callback is not None:
                    await maybe_await(callback(output))

        outcome = await self._api.run_code(self.sandbox_id, _cell(code, envs), context=_context_name(context),
                                           timeout_s=timeout, on_event=on_event)
        execution = _execution(outcome, logs)
        for result in execution.results:
            if on_result is not None:
                await maybe_await(on_result(result))
        if execution.error is not None and on_error is not None:
            await maybe_await(on_error(execution.error))
        return execution

    async def create_code_context(self, cwd: str | None = None, language: str | None = None,
                                  request_timeout: float | None = None) -> Context:
        del request_timeout
        _check_python(language)
        return Context.from_agent(await self._api.create_context(self.sandbox_id, cwd=cwd))

    async def list_code_contexts(self) -> list[Context]:
        return [Context.from_agent(c) for c in await self._api.contexts(self.sandbox_id)]

    async def restart_code_context(self, context: Context | str) -> None:
        await self._api.restart_context(self.sandbox_id, _context_name(context))

    async def remove_code_context(self, context: Context | str) -> None:
        await self._api.remove_context(self.sandbox_id, _context_name(context))

    async def eval(self, expr: str, context: Any = None) -> Any:
        """The value of one Python expression, as ``Sandbox.eval``."""
        return _value(await self._api.eval(self.sandbox_id, expr, context=_context_name(context)))

    # forking

    async def branch(self, tag: str | None = None, mode: Literal["full", "diff", "live"] = "diff",
                     wait: bool = True) -> dict[str, Any]:
        return await self._api.branch(self.sandbox_id, tag=tag or _branch_tag(self.sandbox_id), mode=mode,
                                      wait=wait)

    async def fork(self, count: int = 1, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S) -> list[AsyncSandbox]:
        """As ``Sandbox.fork``: all ``count`` children, or ``ForkFailed`` (the started ones killed)."""
        tag = (await self.branch(mode="diff"))["tag"]
        outcome = ForkOutcome.from_children([child async for child in self._api.fork_iter(tag, count,
                                                                                          timeout_s=timeout)])
        for sandbox_id in outcome.to_kill():
            with contextlib.suppress(ForkdError):
                await self._api.kill(sandbox_id)
        return [AsyncSandbox(sandbox_id, AsyncController(connection=self._api.connection))
                for sandbox_id in outcome.sandbox_ids()]
