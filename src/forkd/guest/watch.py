"""watch.*: directory watchers on inotify (through ctypes; the agent is stdlib only).

A watcher is an inotify descriptor; the kernel queues its events (bounded by
``fs.inotify.max_queued_events``; an overflow is reported, not hidden) until ``watch.read``
collects them, waiting at most a few seconds, so no request holds a worker for long and no
thread is started per watcher. A recursive watcher also watches directories created under it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import itertools
import os
import select
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from . import protocol
from .dispatch import AgentError, Handler, Request

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED, IN_ISDIR = 0x400, 0x800, 0x4000, 0x8000, 0x40000000
IN_ONLYDIR, IN_NONBLOCK, IN_CLOEXEC = 0x01000000, 0o4000, 0o2000000
_MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
         | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR)
# inotify bit → E2B's event type, first match wins.
_TYPES = ((IN_CREATE | IN_MOVED_TO, "create"), (IN_MODIFY | IN_CLOSE_WRITE, "write"),
          (IN_DELETE | IN_DELETE_SELF, "remove"), (IN_MOVED_FROM | IN_MOVE_SELF, "rename"), (IN_ATTRIB, "chmod"))
_HEADER = struct.Struct("iIII")
MAX_WATCHERS = 64
MAX_DIRS = 8192  # per recursive watcher
MAX_EVENTS = 4096  # per watch.read answer
MAX_WAIT_S = 10.0

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


@dataclass
class _Watcher:
    fd: int
    root: str
    recursive: bool
    dirs: dict[int, str] = field(default_factory=dict)  # watch descriptor → directory
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, directory: str) -> None:
        if len(self.dirs) >= MAX_DIRS:
            raise AgentError(protocol.ERR_BAD_REQUEST, f"watch: more than {MAX_DIRS} directories under {self.root}")
        wd = _check(_libc.inotify_add_watch(self.fd, os.fsencode(directory), _MASK), f"watching {directory}")
        self.dirs[wd] = directory

    def add_tree(self, top: str) -> None:
        self.add(top)
        if self.recursive:
            for current, subdirs, _ in os.walk(top):
                for name in subdirs:
                    path = os.path.join(current, name)
                    if not os.path.islink(path):
                        self.add(path)

    def events(self, data: bytes) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _, length = _HEADER.unpack_from(data, offset)
            name = data[offset + _HEADER.size:offset + _HEADER.size + length].rstrip(b"\0")
            offset += _HEADER.size + length
            if mask & IN_Q_OVERFLOW:
                found.append({"name": "", "type": "overflow"})
                continue
            if mask & IN_IGNORED:
                self.dirs.pop(wd, None)
                continue
            directory = self.dirs.get(wd)
            kind = next((t for bit, t in _TYPES if mask & bit), None)
            if directory is None or kind is None:
                continue
            path = os.path.join(directory, os.fsdecode(name)) if name else directory
            found.append({"name": os.path.relpath(path, self.root), "path": path, "type": kind})
            if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                try:
                    self.add_tree(path)
                except OSError:
                    pass  # gone again already
        return found


class WatchOps:
    def __init__(self) -> None:
        self._watchers: dict[str, _Watcher] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Handler]:
        return {protocol.OP_WATCH_CREATE: self.create, protocol.OP_WATCH_READ: self.read,
                protocol.OP_WATCH_REMOVE: self.remove}

    def count(self) -> int:
        """Watches open: a guest with one is never stopped for being idle (its events would wait)."""
        with self._lock:
            return len(self._watchers)

    def shutdown(self) -> None:
        with self._lock:
            for watcher in self._watchers.values():
                os.close(watcher.fd)
            self._watchers.clear()

    def create(self, req: Request) -> dict[str, Any]:
        path = os.path.abspath(req.path("path"))
        recursive = req.arg("recursive", bool, False)
        if not os.path.isdir(path):
            raise FileNotFoundError(errno.ENOENT, f"no directory {path!r} to watch", path)
        with self._lock:
            if len(self._watchers) >= MAX_WATCHERS:
                raise AgentError(protocol.ERR_BAD_REQUEST, f"at most {MAX_WATCHERS} watchers; remove some first")
            watcher = _Watcher(_check(_libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1"), path, recursive)
            try:
                watcher.add_tree(path)
            except BaseException:
                os.close(watcher.fd)
                raise
            watcher_id = f"w{next(self._ids)}"
            self._watchers[watcher_id] = watcher
        return {"id": watcher_id}

    def _get(self, req: Request) -> _Watcher:
        watcher = self._watchers.get(req.arg("id", str))
        if watcher is None:
            raise AgentError(protocol.ERR_NOT_FOUND, f"no watcher {req.arg('id', str)!r}")
        return watcher

    def read(self, req: Request) -> dict[str, Any]:
        """Events queued so far; with ``wait_s``, wait that long for the first one."""
        watcher = self._get(req)
        wait_s = min(req.arg("wait_s", float, 0.0, minimum=0), MAX_WAIT_S)
        events: list[dict[str, Any]] = []
        with watcher.lock:
            try:
                if wait_s:
                    select.select([watcher.fd], [], [], wait_s)
                while len(events) < MAX_EVENTS:
                    try:
                        data = os.read(watcher.fd, 64 * 1024)
                    except BlockingIOError:
                        break
                    events += watcher.events(data)
            except OSError as exc:
                raise AgentError(protocol.ERR_OS, f"reading watcher events: {exc}") from None
        return {"events": events}

    def remove(self, req: Request) -> dict[str, Any]:
        """Not inline: it waits for a read in progress (at most ``MAX_WAIT_S``) before closing the fd."""
        with self._lock:
            watcher = self._watchers.pop(req.arg("id", str), None)
        if watcher is None:
            raise AgentError(protocol.ERR_NOT_FOUND, f"no watcher {req.arg('id', str)!r}")
        with watcher.lock:
            os.close(watcher.fd)
        return {}
