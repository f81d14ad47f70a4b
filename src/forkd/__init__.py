"""forkd: fork warm microVMs copy-on-write — a fresh, isolated Linux VM per task in milliseconds.

``from forkd import Sandbox`` (E2B-compatible), ``AsyncSandbox``, or ``Controller`` (the REST client).
They load on first use, so the daemon and the guest tooling do not import the HTTP client; type checkers
read the same names from the ``TYPE_CHECKING`` imports below (tests/unit/test_sdk_typing.py keeps both lists equal).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forkd.errors import Failure
    from forkd.sdk.async_controller import AsyncController
    from forkd.sdk.connection import ConnectionConfig
    from forkd.sdk.controller import Controller
    from forkd.sdk.errors import (
        AuthenticationException,
        ConflictException,
        DaemonUnreachable,
        ForkdError,
        InvalidArgumentException,
        NotFoundException,
        RateLimitException,
        SandboxException,
        TimeoutException,
    )
    from forkd.sdk.models import (
        ChildOutcome,
        CodeError,
        CommandExitException,
        CommandResult,
        Execution,
        ForkFailed,
        ForkOutcome,
        SandboxInfo,
    )
    from forkd.sdk.sandbox_async import AsyncCommandHandle, AsyncSandbox
    from forkd.sdk.sandbox_sync import CommandHandle, Sandbox

try:  # the one version source is pyproject.toml; an uninstalled source tree says so
    __version__ = version("forkd")
except PackageNotFoundError:  # pragma: no cover - running from a checkout that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "Sandbox": "forkd.sdk.sandbox_sync",
    "CommandHandle": "forkd.sdk.sandbox_sync",
    "AsyncSandbox": "forkd.sdk.sandbox_async",
    "AsyncCommandHandle": "forkd.sdk.sandbox_async",
    "Controller": "forkd.sdk.controller",
    "AsyncController": "forkd.sdk.async_controller",
    "ConnectionConfig": "forkd.sdk.connection",
    "CodeError": "forkd.sdk.models",
    "CommandExitException": "forkd.sdk.models",
    "CommandResult": "forkd.sdk.models",
    "Execution": "forkd.sdk.models",
    "ForkFailed": "forkd.sdk.models",
    "ForkOutcome": "forkd.sdk.models",
    "ChildOutcome": "forkd.sdk.models",
    "SandboxInfo": "forkd.sdk.models",
    "Failure": "forkd.errors",
    "ForkdError": "forkd.sdk.errors",
    "SandboxException": "forkd.sdk.errors",
    "NotFoundException": "forkd.sdk.errors",
    "TimeoutException": "forkd.sdk.errors",
    "AuthenticationException": "forkd.sdk.errors",
    "InvalidArgumentException": "forkd.sdk.errors",
    "ConflictException": "forkd.sdk.errors",
    "RateLimitException": "forkd.sdk.errors",
    "DaemonUnreachable": "forkd.sdk.errors",
}
__all__ = [
    "__version__",
    "Sandbox",
    "CommandHandle",
    "AsyncSandbox",
    "AsyncCommandHandle",
    "Controller",
    "AsyncController",
    "ConnectionConfig",
    "CodeError",
    "CommandExitException",
    "CommandResult",
    "Execution",
    "ForkFailed",
    "ForkOutcome",
    "ChildOutcome",
    "SandboxInfo",
    "Failure",
    "ForkdError",
    "SandboxException",
    "NotFoundException",
    "TimeoutException",
    "AuthenticationException",
    "InvalidArgumentException",
    "ConflictException",
    "RateLimitException",
    "DaemonUnreachable",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'forkd' has no attribute {name!r}")
