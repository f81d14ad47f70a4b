"""What a sandbox's command and file APIs need of it: which sandbox, through which daemon client.

``sandbox.commands`` and ``sandbox.files`` hold their sandbox through these, so those modules never
import the sandbox classes (and a reconnected sandbox's new client is seen at once).
"""

from __future__ import annotations

from typing import Any, Protocol

from forkd.sdk.async_controller import AsyncController
from forkd.sdk.controller import Controller


class SandboxRef(Protocol):
    @property
    def sandbox_id(self) -> str: ...

    @property
    def api(self) -> Controller: ...

    @property
    def commands(self) -> Any: ...


class AsyncSandboxRef(Protocol):
    @property
    def sandbox_id(self) -> str: ...

    @property
    def api(self) -> AsyncController: ...

    @property
    def commands(self) -> Any: ...
