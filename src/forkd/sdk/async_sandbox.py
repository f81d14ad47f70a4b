"""``forkd.AsyncSandbox``: the same interface as ``Sandbox`` for asyncio code (E2B's ``AsyncSandbox``).

Each call runs the synchronous client in a worker thread, so the event loop never blocks and the
two interfaces cannot drift apart. Callbacks may be plain functions or coroutine functions; both
run on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any, Literal

from forkd.sdk.commands import CommandHandle
from forkd.sdk.models import (
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ProcessInfo,
    SandboxInfo,
    WriteInfo,
)
from forkd.sdk.sandbox import DEFAULT_SANDBOX_TIMEOUT_S, Sandbox


def _on_loop(callback: Callable[..., Any] | None, loop: asyncio.AbstractEventLoop) -> Callable[..., Any] | None:
    """A callback the worker thread can call: it runs on ``loop`` and the thread waits for it."""
    if callback is None:
        return None

    def call(*args: Any) -> None:
        async def run() -> None:
            outcome = callback(*args)
            if inspect.isawaitable(outcome):
                await outcome

        asyncio.run_coroutine_threadsafe(run(), loop).result()

    return call


async def _off_loop(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(function, *args, **kwargs)


def _bridged(kwargs: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    return {k: _on_loop(v, loop) if k.startswith("on_") else v for k, v in kwargs.items()}


class AsyncCommandHandle:
    def __init__(self, handle: CommandHandle) -> None:
        self._handle = handle
        self.pid = handle.pid

    async def wait(self, on_stdout: Callable[[str], Any] | None = None,
                   on_stderr: Callable[[str], Any] | None = None) -> CommandResult:
        return await _off_loop(self._handle.wait, **_bridged({"on_stdout": on_stdout, "on_stderr": on_stderr}))

    async def kill(self) -> bool:
        return await _off_loop(self._handle.kill)

    async def send_stdin(self, data: str) -> None:
        await _off_loop(self._handle.send_stdin, data)

    async def disconnect(self) -> None:
        await _off_loop(self._handle.disconnect)


class AsyncCommands:
    def __init__(self, sandbox: Sandbox) -> None:
        self._commands = sandbox.commands

    async def run(self, cmd: str, background: bool | None = None, **kwargs: Any) -> CommandResult | AsyncCommandHandle:
        """As ``Sandbox.commands.run``; callbacks may be coroutine functions."""
        outcome = await _off_loop(self._commands.run, cmd, background, **_bridged(kwargs))
        return AsyncCommandHandle(outcome) if isinstance(outcome, CommandHandle) else outcome

    async def kill(self, pid: int) -> bool:
        return await _off_loop(self._commands.kill, pid)

    async def send_stdin(self, pid: int, data: str) -> None:
        await _off_loop(self._commands.send_stdin, pid, data)

    async def list(self) -> list[ProcessInfo]:
        return await _off_loop(self._commands.list)


class AsyncFilesystem:
    def __init__(self, sandbox: Sandbox) -> None:
        self._files = sandbox.files

    async def read(self, path: str, format: Literal["text", "bytes"] = "text") -> str | bytearray:
        return await _off_loop(self._files.read, path, format)

    async def write(self, path: str, data: Any) -> WriteInfo | list[WriteInfo]:
        return await _off_loop(self._files.write, path, data)

    async def write_files(self, files: list[Any]) -> list[WriteInfo]:
        return await _off_loop(self._files.write_files, files)

    async def list(self, path: str, depth: int = 1) -> list[EntryInfo]:
        return await _off_loop(self._files.list, path, depth)

    async def exists(self, path: str) -> bool:
        return await _off_loop(self._files.exists, path)

    async def get_info(self, path: str) -> EntryInfo:
        return await _off_loop(self._files.get_info, path)

    async def remove(self, path: str) -> None:
        await _off_loop(self._files.remove, path)

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        return await _off_loop(self._files.rename, old_path, new_path)

    async def make_dir(self, path: str) -> bool:
        return await _off_loop(self._files.make_dir, path)


class AsyncSandbox:
    """``await AsyncSandbox.create()``; then ``await sandbox.commands.run(...)`` and so on."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sync = sandbox
        self.sandbox_id = sandbox.sandbox_id
        self.commands = AsyncCommands(sandbox)
        self.files = AsyncFilesystem(sandbox)

    @classmethod
    async def create(cls, template: str | None = None, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S,
                     **kwargs: Any) -> AsyncSandbox:
        return cls(await _off_loop(Sandbox.create, template, timeout, **kwargs))

    @classmethod
    async def connect(cls, sandbox_id: str, **kwargs: Any) -> AsyncSandbox:
        return cls(await _off_loop(Sandbox.connect, sandbox_id, **kwargs))

    @classmethod
    async def list(cls, **kwargs: Any) -> list[SandboxInfo]:
        return await _off_loop(Sandbox.list, **kwargs)

    async def kill(self) -> bool:
        return await _off_loop(self._sync.kill)

    async def set_timeout(self, timeout: float) -> None:
        await _off_loop(self._sync.set_timeout, timeout)

    async def get_info(self) -> SandboxInfo:
        return await _off_loop(self._sync.get_info)

    async def is_running(self) -> bool:
        return await _off_loop(self._sync.is_running)

    async def run_code(self, code: str, **kwargs: Any) -> Execution:
        return await _off_loop(self._sync.run_code, code, **_bridged(kwargs))

    async def create_code_context(self, cwd: str | None = None, language: str | None = None) -> Context:
        return await _off_loop(self._sync.create_code_context, cwd, language)

    async def list_code_contexts(self) -> list[Context]:
        return await _off_loop(self._sync.list_code_contexts)

    async def restart_code_context(self, context: Context | str) -> None:
        await _off_loop(self._sync.restart_code_context, context)

    async def remove_code_context(self, context: Context | str) -> None:
        await _off_loop(self._sync.remove_code_context, context)

    async def eval(self, expr: str, context: Any = None) -> Any:
        return await _off_loop(self._sync.eval, expr, context)

    async def branch(self, tag: str | None = None, mode: Literal["full", "diff", "live"] = "diff",
                     wait: bool = True) -> dict[str, Any]:
        return await _off_loop(self._sync.branch, tag, mode, wait)

    async def fork(self, count: int = 1, timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S) -> list[AsyncSandbox]:
        return [AsyncSandbox(child) for child in await _off_loop(self._sync.fork, count, timeout)]

    async def close(self) -> None:
        await _off_loop(self._sync.close)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *_: object) -> None:
        try:
            await self.kill()
        finally:
            await self.close()
