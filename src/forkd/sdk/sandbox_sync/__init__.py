"""The sync SDK: ``Sandbox`` with its ``commands`` and ``files``, the core (``forkd.sdk.sandbox``) on a ``Controller``."""

from forkd.sdk.sandbox_sync.commands import CommandHandle, Commands
from forkd.sdk.sandbox_sync.filesystem import Filesystem
from forkd.sdk.sandbox_sync.main import Sandbox

__all__ = ["CommandHandle", "Commands", "Filesystem", "Sandbox"]
