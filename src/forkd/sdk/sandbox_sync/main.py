"""``forkd.Sandbox``: E2B's ``Sandbox`` over forkd, so E2B code runs by changing the import.

The methods are the core's (``sandbox/main.py``), run by the sync flavour on a ``Controller``; this
module adds what only the sync interface has: ``Sandbox(...)`` as E2B v1's spelling of ``create``,
``with``, and ``Sandbox.kill(id)`` beside ``sandbox.kill()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from forkd.sdk.controller import SYNC, Controller
from forkd.sdk.sandbox.main import SandboxCore
from forkd.sdk.sandbox_sync.commands import Commands, Pty
from forkd.sdk.sandbox_sync.filesystem import Filesystem


class class_or_instance:  # noqa: N801 - used like the decorators it stands beside
    """``Sandbox.kill(id)`` and ``sandbox.kill()`` both work, as in E2B."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(self, instance: Any, owner: type) -> Callable[..., Any]:
        if instance is not None:
            return functools.partial(self.method, instance)

        def on_class(sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
            sandbox = owner._attach(sandbox_id)
            try:
                return self.method(sandbox, *args, **kwargs)
            finally:
                sandbox.close()

        return on_class


class Sandbox(SandboxCore):
    """One forkd child VM. ``Sandbox.create()`` forks it from a warm snapshot in well under a second."""

    _flavour = SYNC
    _client = Controller
    _commands = Commands
    _files = Filesystem
    _pty = Pty
    commands: Commands
    files: Filesystem
    pty: Pty

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``Sandbox(...)`` is E2B v1's spelling of ``Sandbox.create(...)`` (the same arguments)."""
        created = self.create(*args, **kwargs)
        self._bind(created.sandbox_id, created.api)

    @property
    def api(self) -> Controller:
        return self._api

    kill = class_or_instance(SandboxCore.kill)
    set_timeout = class_or_instance(SandboxCore.set_timeout)
    get_info = class_or_instance(SandboxCore.get_info)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *_: object) -> None:
        self._leave()
