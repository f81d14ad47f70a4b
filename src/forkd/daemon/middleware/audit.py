"""The audit log: one JSON line per request, appended, never rewritten.

Each line says who (client address or ``unix``), what (method, path), the outcome (status,
latency) and which sandbox or snapshot it touched. The file is opened ``O_APPEND`` and each line is
one ``write``, so concurrent requests never interleave; ``reopen`` (on SIGHUP) lets logrotate move
the file away and have a fresh one created.

Anyone who reaches the TCP port writes a line, token or not, so the log has its own budget: every
field is cut to a bounded length (a line is at most about 1 KiB) and the file is rotated at
``max_bytes``, keeping ``backups`` old files, so it never holds more than ``(backups + 1) * max_bytes``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from forkd.daemon.middleware import StatusSeen
from forkd.validation import find_sandbox_id

_PEEK_BYTES = 64 << 10  # bodies this small are read for the snapshot tag they name
MAX_FIELD_CHARS = 256  # a path, method or tag longer than this is cut (and marked)
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_BACKUPS = 3


def bounded(text: str | None) -> str | None:
    if text is None or len(text) <= MAX_FIELD_CHARS:
        return text
    return f"{text[:MAX_FIELD_CHARS]}...(+{len(text) - MAX_FIELD_CHARS} chars)"


class AuditLog:
    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def reopen(self) -> None:
        """After rotation: new appends go to a file at ``path`` again."""
        with self._lock:
            old, self._fd = self._fd, self._open()
            self._size = os.fstat(self._fd).st_size
        os.close(old)

    def _rotate(self) -> None:
        """audit.jsonl → .1 → .2 …, the oldest beyond ``backups`` dropped; a fresh file after. Lock held."""
        for n in range(self.backups, 0, -1):
            source = self.path if n == 1 else self.path.with_name(f"{self.path.name}.{n - 1}")
            if source.exists():
                os.replace(source, self.path.with_name(f"{self.path.name}.{n}"))
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = self._open()
        self._size = 0

    def write(self, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            os.write(self._fd, line)
            self._size += len(line)

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)


class AuditMiddleware:
    """ASGI middleware writing one audit line per HTTP request, whatever its outcome."""

    def __init__(self, app: Any, log: AuditLog, transport: str) -> None:
        self.app = app
        self.log = log
        self.transport = transport

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        head = bytearray()

        async def peeking_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request" and len(head) < _PEEK_BYTES:
                head.extend(message.get("body", b"")[:_PEEK_BYTES - len(head)])
            return message

        seen = StatusSeen(send)
        try:
            await self.app(scope, peeking_receive, seen)
        finally:
            self.log.write(self.entry(scope, seen.status, time.monotonic() - started, bytes(head)))

    def entry(self, scope: dict[str, Any], status: int, seconds: float, head: bytes) -> dict[str, Any]:
        client = scope.get("client")
        params = scope.get("path_params") or {}
        return {
            "time": round(time.time(), 3),
            "client": f"{client[0]}:{client[1]}" if client and self.transport == "tcp" else self.transport,
            "method": bounded(scope["method"]),
            "path": bounded(scope["path"]),
            "status": status,
            "latency_ms": round(seconds * 1000, 2),
            "sandbox_id": find_sandbox_id(scope["path"]),
            "snapshot_tag": bounded(params.get("tag") or _tag_in_body(head)),
        }


def _tag_in_body(head: bytes) -> str | None:
    try:
        body = json.loads(head)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    tag = body.get("snapshot_tag") or body.get("tag")
    return tag if isinstance(tag, str) else None
