"""``forkd.Sandbox``: E2B's ``Sandbox`` over forkd, so E2B code runs by changing the import.

The methods are the core's (``sandbox/main.py``), run by the sync flavour on a ``Controller``; this
module adds what only the sync interface has: ``Sandbox(...)`` as E2B v1's spelling of ``create``,
``with``, and ``Sandbox.kill(id)`` beside ``sandbox.kill()``. The ``TYPE_CHECKING`` block tells type
checkers what the core's flavour-neutral methods answer here (the core documents them).
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, Unpack, overload

from forkd.sdk.controller import SYNC, Controller
from forkd.sdk.sandbox.flavour import SyncSide, operation
from forkd.sdk.sandbox.main import DEFAULT_SANDBOX_TIMEOUT_S, SandboxCore
from forkd.sdk.sandbox_sync.commands import Commands
from forkd.sdk.sandbox_sync.filesystem import Filesystem

if TYPE_CHECKING:
    from forkd.sdk.models import SandboxInfo
    from forkd.sdk.sandbox.options import ConnectOptions, CreateOptions

P = ParamSpec("P")
T = TypeVar("T")


class class_or_instance(Generic[P, T]):  # noqa: N801 - used like the decorators it stands beside
    """``Sandbox.kill(id)`` and ``sandbox.kill()`` both work, as in E2B."""

    def __init__(self, method: operation[Any, P, T]) -> None:
        self.method = method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    @overload
    def __get__(self, instance: None, owner: type[Sandbox]) -> Callable[Concatenate[str, P], T]: ...

    @overload
    def __get__(self, instance: Sandbox, owner: type[Sandbox]) -> Callable[P, T]: ...

    def __get__(self, instance: Sandbox | None, owner: type[Sandbox]) -> Callable[..., Any]:
        if instance is not None:
            return functools.partial(self.method, instance)

        def on_class(sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
            sandbox = owner._attach(sandbox_id)
            try:
                return self.method(sandbox, *args, **kwargs)
            finally:
                sandbox.close()

        return on_class


class Sandbox(SandboxCore, SyncSide):
    """One forkd child VM. ``Sandbox.create()`` forks it from a warm snapshot in well under a second."""

    _flavour = SYNC
    _client = Controller
    _commands = Commands
    _files = Filesystem
    commands: Commands
    files: Filesystem

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``Sandbox(...)`` is E2B v1's spelling of ``Sandbox.create(...)`` (the same arguments)."""
        created = self.create(*args, **kwargs)
        self._bind(created.sandbox_id, created.api)

    @property
    def api(self) -> Controller:
        """The ``Controller`` this sandbox talks through."""
        api: Controller = self._api
        return api

    kill = class_or_instance(SandboxCore.kill)
    set_timeout = class_or_instance(SandboxCore.set_timeout)
    get_info = class_or_instance(SandboxCore.get_info)

    if TYPE_CHECKING:
        @classmethod
        def create(cls, template: str | None = None,  # type: ignore[override]
                   timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S,
                   metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
                   **options: Unpack[CreateOptions]) -> Sandbox: ...

        @classmethod
        def connect(cls, sandbox_id: str, **options: Unpack[ConnectOptions]) -> Sandbox: ...  # type: ignore[override]

        @classmethod
        def list(cls, **options: Unpack[ConnectOptions]) -> builtins.list[SandboxInfo]: ...  # type: ignore[override]

        def fork(self, count: int = 1,
                 timeout: float | None = DEFAULT_SANDBOX_TIMEOUT_S) -> builtins.list[Sandbox]: ...

        def close(self) -> None: ...

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *_: object) -> None:
        self._leave()
