"""The asyncio SDK: ``AsyncSandbox`` with its ``commands`` and ``files``, the core (``forkd.sdk.sandbox``) on an
``AsyncController``."""

from forkd.sdk.sandbox_async.commands import AsyncCommandHandle, AsyncCommands
from forkd.sdk.sandbox_async.filesystem import AsyncFilesystem
from forkd.sdk.sandbox_async.main import AsyncSandbox

__all__ = ["AsyncCommandHandle", "AsyncCommands", "AsyncFilesystem", "AsyncSandbox"]
