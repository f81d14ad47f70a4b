"""forkd: fork warm microVMs copy-on-write — a fresh, isolated Linux VM per task in milliseconds.

``from forkd import Sandbox`` (E2B-compatible), ``AsyncSandbox``, or ``Controller`` (the REST client).
They load on first use, so the daemon and the guest tooling do not import the HTTP client.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Sandbox": "forkd.sdk.sandbox_sync",
    "AsyncSandbox": "forkd.sdk.sandbox_async",
    "Controller": "forkd.sdk.controller",
    "ConnectionConfig": "forkd.sdk.connection",
    "CommandExitException": "forkd.sdk.models",
    "CommandResult": "forkd.sdk.models",
    "Execution": "forkd.sdk.models",
    "ForkFailed": "forkd.sdk.models",
    "ForkOutcome": "forkd.sdk.models",
    "ChildOutcome": "forkd.sdk.models",
    "Failure": "forkd.errors",
    "ForkdError": "forkd.sdk.errors",
    "SandboxException": "forkd.sdk.errors",
    "NotFoundException": "forkd.sdk.errors",
    "TimeoutException": "forkd.sdk.errors",
    "AuthenticationException": "forkd.sdk.errors",
    "InvalidArgumentException": "forkd.sdk.errors",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'forkd' has no attribute {name!r}")
