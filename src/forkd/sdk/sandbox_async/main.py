"""``forkd.AsyncSandbox``: ``Sandbox``'s interface for asyncio code (E2B's ``AsyncSandbox``), on ``httpx.AsyncClient``.

The methods are the core's (``sandbox/main.py``), each a coroutine here: the async flavour runs them
on an ``AsyncController``, so nothing blocks the event loop. Callbacks may be plain functions or
coroutine functions.
"""

from __future__ import annotations

from forkd.sdk.async_controller import ASYNC, AsyncController
from forkd.sdk.sandbox.main import SandboxCore
from forkd.sdk.sandbox_async.commands import AsyncCommands, AsyncPty
from forkd.sdk.sandbox_async.filesystem import AsyncFilesystem


class AsyncSandbox(SandboxCore):
    """``sbx = await AsyncSandbox.create()``; then ``await sbx.commands.run(...)`` and so on."""

    _flavour = ASYNC
    _client = AsyncController
    _commands = AsyncCommands
    _files = AsyncFilesystem
    _pty = AsyncPty
    commands: AsyncCommands
    files: AsyncFilesystem
    pty: AsyncPty

    def __init__(self, sandbox_id: str, api: AsyncController) -> None:
        """A handle on sandbox ``sandbox_id`` through ``api`` (use ``create`` or ``connect`` to get one)."""
        self._bind(sandbox_id, api)

    @property
    def api(self) -> AsyncController:
        return self._api

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._leave()
