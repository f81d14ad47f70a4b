"""``forkd.AsyncSandbox``: ``Sandbox``'s interface for asyncio code (E2B's ``AsyncSandbox``), on ``httpx.AsyncClient``.

The methods are the core's (``sandbox/main.py``), each a coroutine here: the async flavour runs them
on an ``AsyncController``, so nothing blocks the event loop. Callbacks may be plain functions or
coroutine functions. The ``TYPE_CHECKING`` block tells type checkers what the core's flavour-neutral
methods answer here (the core documents them).
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Unpack

from forkd.sdk.async_controller import ASYNC, AsyncController
from forkd.sdk.sandbox.flavour import AsyncSide
from forkd.sdk.sandbox.main import DEFAULT_SANDBOX_TIMEOUT_S, SandboxCore
from forkd.sdk.sandbox_async.commands import AsyncCommands
from forkd.sdk.sandbox_async.filesystem import AsyncFilesystem

if TYPE_CHECKING:
    from forkd.sdk.models import SandboxInfo
    from forkd.sdk.sandbox.options import ConnectOptions, CreateOptions


class AsyncSandbox(SandboxCore, AsyncSide):
    """``sbx = await AsyncSandbox.create()``; then ``await sbx.commands.run(...)`` and so on."""

    _flavour = ASYNC
    _client = AsyncController
    _commands = AsyncCommands
    _files = AsyncFilesystem
    commands: AsyncCommands
    files: AsyncFilesystem

    def __init__(self, sandbox_id: str, api: AsyncController) -> None:
        """A handle on sandbox ``sandbox_id`` through ``api`` (use ``create`` or ``connect`` to get one)."""
        self._bind(sandbox_id, api)

    @property
    def api(self) -> AsyncController:
        """The ``AsyncController`` this sandbox talks through."""
        api: AsyncController = self._api
        return api

    if TYPE_CHECKING:
        @classmethod
        async def create(cls, template: str | None = None,  # type: ignore[override]
                   timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S,
                         metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
                         **options: Unpack[CreateOptions]) -> AsyncSandbox: ...

        @classmethod
        async def connect(cls, sandbox_id: str, **options: Unpack[ConnectOptions]) -> AsyncSandbox: ...  # type: ignore[override]

        @classmethod
        async def list(cls, **options: Unpack[ConnectOptions]) -> builtins.list[SandboxInfo]: ...  # type: ignore[override]

        async def fork(self, count: int = 1,
                       timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S) -> builtins.list[AsyncSandbox]: ...

        async def close(self) -> None: ...

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._leave()
