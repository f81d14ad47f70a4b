"""What a sandbox's command and file APIs need of it: which sandbox, through which daemon client.

``sandbox.commands`` and ``sandbox.files`` hold their sandbox through this, so those modules never
import the ``Sandbox`` class (and a reconnected sandbox's new client is seen at once).
"""

from __future__ import annotations

from typing import Protocol

from forkd.sdk.controller import Controller


class SandboxRef(Protocol):
    @property
    def sandbox_id(self) -> str: ...

    @property
    def api(self) -> Controller: ...
