"""``AsyncSandbox.commands``: the core's commands (``sandbox/commands.py``) as coroutines."""

from __future__ import annotations

from collections.abc import AsyncIterator

from forkd.sdk.async_controller import ASYNC
from forkd.sdk.sandbox.commands import CommandHandleCore, CommandsCore, Piece, PtyCore


class AsyncCommandHandle(CommandHandleCore):
    """``CommandHandle`` for asyncio: ``await handle.wait()``, ``async for`` its output pieces."""

    _flavour = ASYNC

    async def __aiter__(self) -> AsyncIterator[Piece]:
        async for event in self._iterator:
            if (piece := self._take(event)) is not None:
                yield piece


class AsyncCommands(CommandsCore):
    _flavour = ASYNC
    _handle = AsyncCommandHandle


class AsyncPty(PtyCore):
    _flavour = ASYNC
    _handle = AsyncCommandHandle
