"""envd's ``filesystem.Filesystem`` service on the guest agent's files.* ops."""

from __future__ import annotations

import stat
from collections import deque
from typing import Any

from forkd.e2b.errors import ConnectError
from forkd.e2b.rpc import Call, Message, Method
from forkd.e2b.sandboxes import rfc3339
from forkd.guest import protocol

MAX_LIST_ENTRIES = 10_000  # a ListDir answer; deeper trees are refused, not truncated
MAX_DEPTH = 64
_TYPES = {"file": ("FILE_TYPE_FILE", stat.S_IFREG), "dir": ("FILE_TYPE_DIRECTORY", stat.S_IFDIR),
          "symlink": ("FILE_TYPE_SYMLINK", stat.S_IFLNK)}


def entry_info(entry: dict[str, Any]) -> Message:
    """envd's ``EntryInfo`` for an agent file entry."""
    kind, bits = _TYPES.get(entry.get("type", ""), ("FILE_TYPE_UNSPECIFIED", 0))
    mode = int(entry.get("mode", 0))
    return {"name": entry["name"], "type": kind, "path": entry["path"], "size": int(entry.get("size", 0)),
            "mode": mode, "permissions": stat.filemode(bits | mode), "owner": "", "group": "",
            "modifiedTime": rfc3339(float(entry.get("mtime", 0)))}


def _path(message: Message, key: str = "path") -> str:
    path = message.get(key)
    if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096:
        raise ConnectError("invalid_argument", f"{key} must be a non-empty path")
    return path


class FilesystemService:
    def methods(self) -> dict[str, Method]:
        return {
            "/filesystem.Filesystem/Stat": Method("unary", self.stat),
            "/filesystem.Filesystem/ListDir": Method("unary", self.list_dir),
            "/filesystem.Filesystem/MakeDir": Method("unary", self.make_dir),
            "/filesystem.Filesystem/Move": Method("unary", self.move),
            "/filesystem.Filesystem/Remove": Method("unary", self.remove),
        }

    async def _stat(self, call: Call, path: str) -> Message:
        return entry_info(await call.live.agent.call(protocol.OP_FILES_STAT, {"path": path}))

    async def stat(self, call: Call, message: Message) -> Message:
        return {"entry": await self._stat(call, _path(message))}

    async def list_dir(self, call: Call, message: Message) -> Message:
        depth = message.get("depth") or 1
        if not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
            raise ConnectError("invalid_argument", f"depth must be 1..{MAX_DEPTH}")
        entries: list[Message] = []
        pending = deque([(_path(message), 1)])
        while pending:
            directory, level = pending.popleft()
            listed = await call.live.agent.call(protocol.OP_FILES_LIST, {"path": directory})
            for entry in listed.get("entries", []):
                entries.append(entry_info(entry))
                if len(entries) > MAX_LIST_ENTRIES:
                    raise ConnectError("resource_exhausted", f"more than {MAX_LIST_ENTRIES} entries; list with a "
                                                             "smaller depth or a deeper path")
                if entry.get("type") == "dir" and level < depth:
                    pending.append((entry["path"], level + 1))
        return {"entries": entries}

    async def make_dir(self, call: Call, message: Message) -> Message:
        path = _path(message)
        await call.live.agent.call(protocol.OP_FILES_MKDIR, {"path": path, "parents": True, "exist_ok": False})
        return {"entry": await self._stat(call, path)}

    async def move(self, call: Call, message: Message) -> Message:
        source, destination = _path(message, "source"), _path(message, "destination")
        await call.live.agent.call(protocol.OP_FILES_RENAME, {"src": source, "dst": destination})
        return {"entry": await self._stat(call, destination)}

    async def remove(self, call: Call, message: Message) -> Message:
        await call.live.agent.call(protocol.OP_FILES_REMOVE, {"path": _path(message), "recursive": True})
        return {}
