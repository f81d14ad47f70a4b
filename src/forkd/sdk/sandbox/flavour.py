"""How one method serves ``Sandbox`` and ``AsyncSandbox``: the core's methods are step generators.

Wherever a core method needs something that may have to be waited for — a daemon call, the next
event of a stream, a user's callback — it *yields* what it got: a value from the sync
``Controller``, an awaitable from the ``AsyncController``, and is sent back the value. A flavour
runs the generator: the sync one (``controller.SYNC``) straight through, the async one
(``async_controller.ASYNC``) awaiting each awaitable and throwing an error back in where it was
yielded, so a ``try``/``except``/``finally`` in a method works for both. Requests are built and
answers read once; a flavour only decides how to wait. (``operations.Operations`` does the same for
single calls, which answer a value or an awaitable of it, and uses steps for ``read_file``.)

A call is written inside the ``try`` that handles its errors (``yield api.kill(...)`` in the ``try``
block, never made beforehand and yielded later): the sync flavour runs it where it is written.

``@operation`` turns a step generator into the public method; ``Core.method.steps`` is the generator
function, for a method that runs another one's steps inside its own (``yield from``).
"""
from __future__ import annotations

import functools
import types
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import IO, Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

from forkd.sdk.errors import NotFoundException

T = TypeVar("T")
P = ParamSpec("P")
Obj = TypeVar("Obj")
#: A core method's body: yields what may need waiting for, is sent its value, returns the answer.
Steps = Generator[Any, Any, T]


@dataclass(frozen=True)
class Flavour:
    """What a client flavour supplies: how to run steps and how to walk a stream, as values or awaitables."""

    run: Callable[[Steps[Any]], Any]  # the answer (sync) or an awaitable of it (async)
    iterate: Callable[[Any], Any]  # an event stream's iterator: iter() or aiter()
    next: Callable[[Any], Any]  # its next item, None at the end: a value, or an awaitable of it
    collect: Callable[[Any], Any]  # every item of an iterable, as a list (or an awaitable of one)
    close: Callable[[Any], Any]  # end a generator early (its ``finally`` runs): close() or aclose()
    pieces: Callable[[IO[Any]], Any]  # a file object read in upload pieces: an iterator or async iterator
    sleep: Callable[[float], Any]  # wait that many seconds: time.sleep or asyncio.sleep


class Flavoured(Protocol):
    _flavour: Flavour


class SandboxRef(Protocol):
    """What ``commands`` and ``files`` need of their sandbox: its id and its daemon client (of either flavour)."""

    @property
    def sandbox_id(self) -> str: ...

    @property
    def api(self) -> Any: ...

    @property
    def commands(self) -> Any: ...


class SyncSide:
    """Marks an object of the sync flavour for type checkers: its operations answer values."""


class AsyncSide:
    """Marks an object of the async flavour for type checkers: its operations answer coroutines."""


class SidedMethod(Generic[P, T]):
    """A method whose answer a type checker reads by its object's side: ``T`` on a ``SyncSide`` object, a
    coroutine of ``T`` on an ``AsyncSide`` one (the subclass's ``__call__`` does the work)."""

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    @overload
    def __get__(self, instance: None, owner: type[Any] | None = None) -> Self: ...

    @overload
    def __get__(self, instance: SyncSide, owner: type[Any] | None = None) -> Callable[P, T]: ...

    @overload
    def __get__(self, instance: AsyncSide, owner: type[Any] | None = None) -> Callable[P, Coroutine[Any, Any, T]]: ...

    @overload
    def __get__(self, instance: object, owner: type[Any] | None = None) -> Callable[P, Any]: ...

    def __get__(self, instance: object, owner: type[Any] | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)


class operation(SidedMethod[P, T], Generic[Obj, P, T]):  # noqa: N801 - used as a decorator, like the ones it stands beside
    """The public method for a step generator, run by its object's flavour: ``sandbox.eval(...)`` answers
    the value (sync) or an awaitable of it (async). ``steps`` is the generator function itself."""

    def __init__(self, steps: Callable[Concatenate[Obj, P], Steps[T]]) -> None:
        self.steps = steps
        functools.update_wrapper(self, steps)

    def __call__(self, obj: Flavoured, *args: Any, **kwargs: Any) -> Any:
        return obj._flavour.run(self.steps(obj, *args, **kwargs))  # type: ignore[arg-type]


def found(call: Callable[..., object], *args: Any) -> Steps[bool]:
    """Steps: whether ``call(*args)`` succeeded; ``False`` when the daemon answered not found (``kill`` of a
    sandbox that already ended, ``exists`` of a missing path), any other error raised."""
    try:
        yield call(*args)
    except NotFoundException:
        return False
    return True


def upload_piece(piece: str | bytes) -> bytes:
    """One piece read from a file object being uploaded (text files give ``str``)."""
    return piece.encode() if isinstance(piece, str) else piece


UPLOAD_PIECE_BYTES = 1 << 20
