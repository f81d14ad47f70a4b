"""``Sandbox.commands``: the core's commands (``sandbox/commands.py``), run by the sync flavour."""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal, Unpack, overload

from forkd.sdk.controller import SYNC
from forkd.sdk.sandbox.commands import CommandHandleCore, CommandsCore, Piece
from forkd.sdk.sandbox.flavour import SyncSide

if TYPE_CHECKING:
    from forkd.sdk.models import CommandResult, ProcessInfo
    from forkd.sdk.sandbox.options import RunOptions


class CommandHandle(CommandHandleCore, SyncSide):
    """A command started in the background: ``pid``, ``wait()``, ``kill()``, ``send_stdin()``; iterate it
    for its ``(stdout, stderr, pty)`` pieces as they arrive, as E2B's handle yields them."""

    _flavour = SYNC

    def __iter__(self) -> Iterator[Piece]:
        for event in self._iterator:
            if (piece := self._take(event)) is not None:
                yield piece

    if TYPE_CHECKING:
        def kill(self) -> bool: ...
        def send_stdin(self, data: str) -> None: ...
        def disconnect(self) -> None: ...


class Commands(CommandsCore, SyncSide):
    """``sandbox.commands``: shell commands (``/bin/sh -c``) in the sandbox; the core documents each method."""

    _flavour = SYNC
    _handle = CommandHandle

    if TYPE_CHECKING:
        @overload  # type: ignore[override]
        def run(self, cmd: str, background: Literal[False] | None = None,
                **options: Unpack[RunOptions]) -> CommandResult: ...

        @overload
        def run(self, cmd: str, background: Literal[True], **options: Unpack[RunOptions]) -> CommandHandle: ...

        def run(self, cmd: str, background: bool | None = None,
                **options: Unpack[RunOptions]) -> CommandResult | CommandHandle: ...

        def kill(self, pid: int) -> bool: ...
        def send_stdin(self, pid: int, data: str) -> None: ...
        def close_stdin(self, pid: int) -> None: ...
        def list(self) -> builtins.list[ProcessInfo]: ...
