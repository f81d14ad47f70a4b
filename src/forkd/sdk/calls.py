"""One request to the daemon and how to read its answer (``Call``), the builders several clients share, and
``request``, which turns a method that builds a ``Call[T]`` into an operation answering ``T`` (sync) or an
awaitable of it (async). ``operations.Operations`` writes the REST API with them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast

from forkd.sdk.errors import ForkdError
from forkd.sdk.records import CommandOutcome, ForkAnswer
from forkd.sdk.sandbox.flavour import SidedMethod

T = TypeVar("T")
P = ParamSpec("P")
LONG_TIMEOUT_S = 3600.0
FORK_OPTIONS = ("timeout_s", "envs", "metadata", "net", "egress", "memory_limit_mib", "cpu_quota", "cpu_weight",
                "pids_max", "deadline_s", "snapshot_digest", "idempotency_key", "owner")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its answer ``T`` (``key``: the answer's field to return; ``void``: None)."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    content: Any = None
    timeout: float | None = None  # None: the connection's request timeout
    key: str | None = None
    void: bool = False

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``httpx.Client.request``/``stream`` (and the async ones)."""
        found = {"params": self.params, "json": self.json, "content": self.content, "timeout": self.timeout}
        return {name: value for name, value in found.items() if value is not None}

    def streamed(self) -> Call[T]:
        """The same request asking for NDJSON (``"stream": true``), with a long timeout."""
        return Call(self.method, self.path, self.params, {**(self.json or {}), "stream": True}, self.content,
                    LONG_TIMEOUT_S, self.key, self.void)

    def parse(self, answer: Any) -> T:
        """The part of the daemon's JSON answer this call returns (the daemon's schema makes it a ``T``)."""
        if self.void:
            return cast(T, None)
        return cast(T, answer if self.key is None else answer[self.key])


def fork_call(tag: str | None, n: int, options: dict[str, Any]) -> Call[ForkAnswer]:
    unknown = set(options) - {*FORK_OPTIONS, "self", "tag", "n"}
    if unknown:
        raise TypeError(f"unknown fork options: {', '.join(sorted(unknown))}")
    body = {"n": n, **{k: options[k] for k in FORK_OPTIONS if options.get(k) is not None}}
    if tag is not None:
        body["snapshot_tag"] = tag
    return Call("POST", "/v1/sandboxes", json=body, timeout=LONG_TIMEOUT_S)


def exec_call(sandbox_id: str, cmd: str | list[str], env: dict[str, str] | None, cwd: str | None,
              stdin: str | None, timeout_s: float | None, user: str | None, warm: bool = False) -> Call[CommandOutcome]:
    body: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    body.update({"env": env or {}, "timeout_s": timeout_s})
    if warm:
        body["warm"] = True
    optional = {"cwd": cwd, "stdin": stdin, "user": user}
    body.update({key: value for key, value in optional.items() if value is not None})
    return Call("POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body, timeout=call_timeout(timeout_s))


def read_file_call(sandbox_id: str, path: str) -> Call[bytes]:
    return Call("GET", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path}, timeout=LONG_TIMEOUT_S)


def append_bounded(data: bytearray, chunk: bytes, max_bytes: int | None, path: str) -> None:
    """Add a downloaded chunk, refusing (413 ``too_large``) as soon as the file holds more than ``max_bytes``.

    A guest decides what a path holds (a symlink to /dev/zero never ends), so a caller that cannot hold
    any size passes ``max_bytes``; the download stops there.
    """
    data += chunk
    if max_bytes is not None and len(data) > max_bytes:
        raise ForkdError(413, "too_large", f"{path} holds more than {max_bytes} bytes; read it in "
                         "parts (e.g. exec 'head -c N') or raise the limit")


def call_timeout(timeout_s: float | None) -> float:
    return LONG_TIMEOUT_S if timeout_s is None else timeout_s + 60.0


class request(SidedMethod[P, T]):  # noqa: N801 - used as a decorator
    """An operation written as the ``Call`` it sends: the client sends it (``_send``) and answers the value
    (``Controller``) or an awaitable of it (``AsyncController``); type checkers read ``T`` from the ``Call[T]``."""

    def __init__(self, build: Callable[Concatenate[Any, P], Call[T]]) -> None:
        self.build = build
        functools.update_wrapper(self, build)

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return obj._send(self.build(obj, *args, **kwargs))
