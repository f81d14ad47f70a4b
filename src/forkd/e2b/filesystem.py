"""envd's ``filesystem.Filesystem`` service, an adapter over the runtime's sessions (files and directory watchers)."""

from __future__ import annotations

import stat
import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from forkd.e2b.errors import ConnectError
from forkd.e2b.rpc import Call, Message, Method
from forkd.e2b.sandboxes import rfc3339
from forkd.runtime.sessions import Sessions

MAX_LIST_ENTRIES = 10_000  # a ListDir answer; deeper trees are refused, not truncated
MAX_DEPTH = 64
WATCH_POLL_S = 1.0  # how long one watch.read waits in the guest; between reads a stream notices a disconnect
_EVENT_TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE",
                "rename": "EVENT_TYPE_RENAME", "chmod": "EVENT_TYPE_CHMOD"}
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
    """envd's ``filesystem.Filesystem`` service, an adapter over the runtime's sessions (files, watchers)."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    def methods(self) -> dict[str, Method]:
        return {
            "/filesystem.Filesystem/Stat": Method("unary", self.stat),
            "/filesystem.Filesystem/ListDir": Method("unary", self.list_dir),
            "/filesystem.Filesystem/MakeDir": Method("unary", self.make_dir),
            "/filesystem.Filesystem/Move": Method("unary", self.move),
            "/filesystem.Filesystem/Remove": Method("unary", self.remove),
            "/filesystem.Filesystem/WatchDir": Method("server_stream", self.watch_dir),
            "/filesystem.Filesystem/CreateWatcher": Method("unary", self.create_watcher),
            "/filesystem.Filesystem/GetWatcherEvents": Method("unary", self.get_watcher_events),
            "/filesystem.Filesystem/RemoveWatcher": Method("unary", self.remove_watcher),
        }

    async def _stat(self, call: Call, path: str) -> Message:
        return entry_info(await self.sessions.stat(call.live.record.id, path))

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
            listed = await self.sessions.list_files(call.live.record.id, directory)
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
        await self.sessions.make_dir(call.live.record.id, path, exist_ok=False)
        return {"entry": await self._stat(call, path)}

    async def move(self, call: Call, message: Message) -> Message:
        source, destination = _path(message, "source"), _path(message, "destination")
        await self.sessions.rename(call.live.record.id, source, destination)
        return {"entry": await self._stat(call, destination)}

    async def remove(self, call: Call, message: Message) -> Message:
        await self.sessions.remove(call.live.record.id, _path(message), recursive=True)
        return {}

    async def _watch(self, call: Call, message: Message) -> str:
        return await self.sessions.watch(call.live.record.id, _path(message), bool(message.get("recursive")))

    async def _events(self, call: Call, watcher: str, wait_s: float, include_entry: bool) -> list[Message]:
        events = []
        for event in await self.sessions.watch_events(call.live.record.id, watcher, wait_s):
            kind = _EVENT_TYPES.get(event.get("type", ""))
            if kind is None:
                continue  # the kernel's queue overflowed: those events are lost either way
            found: Message = {"name": event["name"], "type": kind}
            if include_entry and kind not in ("EVENT_TYPE_REMOVE", "EVENT_TYPE_RENAME"):
                try:
                    found["entry"] = await self._stat(call, event["path"])
                except Exception:
                    pass  # gone again already
            events.append(found)
        return events

    async def watch_dir(self, call: Call, message: Message) -> AsyncIterator[Message]:
        watcher = await self._watch(call, message)
        include_entry = bool(message.get("includeEntry"))

        async def stream() -> AsyncIterator[Message]:
            try:
                yield {"start": {}}
                while True:
                    events = await self._events(call, watcher, WATCH_POLL_S, include_entry)
                    for event in events:
                        yield {"filesystem": event}
                    if not events:
                        yield {"keepalive": {}}
            finally:  # the client went away: free the guest's watcher without awaiting in a cancelled task
                cleanup = asyncio.get_running_loop().create_task(self.sessions.unwatch(call.live.record.id, watcher))
                _CLEANUPS.add(cleanup)
                cleanup.add_done_callback(_CLEANUPS.discard)

        return stream()

    async def create_watcher(self, call: Call, message: Message) -> Message:
        return {"watcherId": await self._watch(call, message)}

    async def get_watcher_events(self, call: Call, message: Message) -> Message:
        watcher = message.get("watcherId")
        if not isinstance(watcher, str) or not watcher:
            raise ConnectError("invalid_argument", "watcherId is required")
        return {"events": await self._events(call, watcher, 0.0, False)}

    async def remove_watcher(self, call: Call, message: Message) -> Message:
        watcher = message.get("watcherId")
        if not isinstance(watcher, str) or not watcher:
            raise ConnectError("invalid_argument", "watcherId is required")
        await self.sessions.unwatch(call.live.record.id, watcher)
        return {}


_CLEANUPS: set[asyncio.Task[Any]] = set()  # watcher removals still running after their stream ended
