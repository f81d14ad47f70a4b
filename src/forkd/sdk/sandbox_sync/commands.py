"""``Sandbox.commands``: the core's commands (``sandbox/commands.py``), run by the sync flavour."""

from __future__ import annotations

from collections.abc import Iterator

from forkd.sdk.controller import SYNC
from forkd.sdk.sandbox.commands import CommandHandleCore, CommandsCore, Piece, PtyCore


class CommandHandle(CommandHandleCore):
    """A command started in the background: ``pid``, ``wait()``, ``kill()``, ``send_stdin()``; iterate it
    for its ``(stdout, stderr, pty)`` pieces as they arrive, as E2B's handle yields them."""

    _flavour = SYNC

    def __iter__(self) -> Iterator[Piece]:
        for event in self._iterator:
            if (piece := self._take(event)) is not None:
                yield piece


class Commands(CommandsCore):
    _flavour = SYNC
    _handle = CommandHandle


class Pty(PtyCore):
    _flavour = SYNC
    _handle = CommandHandle
