"""``AsyncSandbox.commands``: the core's commands (``sandbox/commands.py``) as coroutines."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal, Unpack, overload

from forkd.sdk.async_controller import ASYNC
from forkd.sdk.sandbox.commands import CommandHandleCore, CommandsCore, Piece
from forkd.sdk.sandbox.flavour import AsyncSide

if TYPE_CHECKING:
    from forkd.sdk.models import CommandResult, ProcessInfo
    from forkd.sdk.sandbox.options import RunOptions


class AsyncCommandHandle(CommandHandleCore, AsyncSide):
    """``CommandHandle`` for asyncio: ``await handle.wait()``, ``async for`` its output pieces."""

    _flavour = ASYNC

    async def __aiter__(self) -> AsyncIterator[Piece]:
        async for event in self._iterator:
            if (piece := self._take(event)) is not None:
                yield piece

    if TYPE_CHECKING:
        async def kill(self) -> bool: ...
        async def send_stdin(self, data: str) -> None: ...
        async def disconnect(self) -> None: ...


class AsyncCommands(CommandsCore, AsyncSide):
    """``sandbox.commands`` for asyncio: each method a coroutine; the core documents each method."""

    _flavour = ASYNC
    _handle = AsyncCommandHandle

    if TYPE_CHECKING:
        @overload  # type: ignore[override]
        async def run(self, cmd: str, background: Literal[False] | None = None,
                      **options: Unpack[RunOptions]) -> CommandResult: ...

        @overload
        async def run(self, cmd: str, background: Literal[True],
                      **options: Unpack[RunOptions]) -> AsyncCommandHandle: ...

        async def run(self, cmd: str, background: bool | None = None,
                      **options: Unpack[RunOptions]) -> CommandResult | AsyncCommandHandle: ...

        async def kill(self, pid: int) -> bool: ...
        async def send_stdin(self, pid: int, data: str) -> None: ...
        async def close_stdin(self, pid: int) -> None: ...
        async def list(self) -> builtins.list[ProcessInfo]: ...
