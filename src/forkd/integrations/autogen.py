"""An AutoGen code executor over forkd (``pip install 'forkd[autogen]'``): the code blocks an agent writes run in a
microVM forked from a warm snapshot, never on the host.

    async with ForkdCodeExecutor(template="quickstart") as executor:
        agent = CodeExecutorAgent("runner", code_executor=executor)   # autogen-agentchat

``python`` blocks run as cells of one persistent context (state survives between blocks and calls, as in a
notebook); ``sh``/``bash``/``shell`` blocks as ``/bin/sh -c`` commands. The first failing block stops the run and
its exit code is the result's; a block in another language fails with exit code 1. ``restart()`` forks a fresh sandbox from the snapshot (milliseconds).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from autogen_core import CancellationToken
from autogen_core.code_executor import CodeBlock, CodeExecutor, CodeResult

from forkd.integrations.output import command_text, execution_text
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.models import CommandExitException
from forkd.sdk.sandbox_async import AsyncSandbox

PYTHON = frozenset({"python", "py", "python3"})
SHELL = frozenset({"sh", "bash", "shell", "console"})
T = TypeVar("T")


class ForkdCodeExecutor(CodeExecutor):
    """AutoGen's ``CodeExecutor`` on a forkd sandbox: ``start()`` forks it from ``template``, ``stop()`` kills it.

    Given ``sandbox``, the executor uses that running sandbox and leaves it running on ``stop()``.
    """

    def __init__(self, template: str | None = None, *, timeout: float = 60.0,
                 connection: ConnectionConfig | None = None, sandbox: AsyncSandbox | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, not {timeout!r}")
        self._template = template
        self._timeout = timeout
        self._connection = connection
        self._sandbox = sandbox
        self._owned = sandbox is None

    @property
    def sandbox(self) -> AsyncSandbox | None:
        """The sandbox the blocks run in (None before ``start()``)."""
        return self._sandbox

    async def start(self) -> None:
        """Fork the sandbox (a no-op when it runs already)."""
        if self._sandbox is None:
            self._sandbox = await AsyncSandbox.create(self._template, connection=self._connection)
            self._owned = True

    async def stop(self) -> None:
        """Kill the sandbox this executor forked (one it was given keeps running) and close the connection."""
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is None:
            return
        if self._owned:
            await sandbox.kill()
        await sandbox.close()

    async def restart(self) -> None:
        """A fresh sandbox from the snapshot: every variable and file of the old one is gone."""
        if not self._owned:
            raise ValueError("this executor was given its sandbox: restart it by creating a new executor")
        await self.stop()
        await self.start()

    async def execute_code_blocks(self, code_blocks: list[CodeBlock],
                                  cancellation_token: CancellationToken) -> CodeResult:
        """Run the blocks in order; the output of each, and the exit code of the first that failed (else 0)."""
        await self.start()
        outputs: list[str] = []
        for block in code_blocks:
            exit_code, output = await self._cancellable(self._run(block), cancellation_token)
            outputs.append(output)
            if exit_code != 0:
                return CodeResult(exit_code=exit_code, output="\n".join(outputs))
        return CodeResult(exit_code=0, output="\n".join(outputs))

    async def _run(self, block: CodeBlock) -> tuple[int, str]:
        sandbox = self._sandbox
        assert sandbox is not None  # started by execute_code_blocks
        language = block.language.strip().lower()
        if language in PYTHON:
            execution = await sandbox.run_code(block.code, timeout=self._timeout)
            return (1 if execution.error is not None else 0), execution_text(execution)
        if language in SHELL:
            try:
                return 0, command_text(await sandbox.commands.run(block.code, timeout=self._timeout))
            except CommandExitException as exc:
                return exc.exit_code, command_text(exc)
        return 1, f"forkd runs python and sh code blocks, not {block.language!r}"

    @staticmethod
    async def _cancellable(work: Awaitable[T], cancellation_token: CancellationToken) -> T:
        """``work``, cancelled when the agent's token is (the request is dropped and the daemon ends the call)."""
        future = asyncio.ensure_future(work)
        cancellation_token.link_future(future)
        return await future
