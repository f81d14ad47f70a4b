"""Guarding a listener that hands out control of sandboxes: the daemon's API and ``forkd-mcp``'s HTTP endpoint.

A Unix socket is guarded by its file mode (0600 from the moment it is bound: only its owner
connects). TCP has no such guard, so a TCP listener needs a bearer token fit for the network,
compared in constant time; a token kept in a file is refused unless only its owner may read it.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import ssl
import stat
import tempfile
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
                   Awaitable[None]]

MIN_TOKEN_CHARS = 32
MAX_TOKEN_FILE_BYTES = 4096
_PLACEHOLDERS = ("changeme", "change-me", "change_me", "token", "secret", "password", "example", "your",
                 "placeholder", "default", "forkd", "xxxx", "test", "1234")


class ListenerError(ValueError):
    """A listener cannot be set up as asked; the message says what to change."""


class TokenRejected(ListenerError):
    pass


class SocketInUse(RuntimeError):
    """Another process already answers on a Unix socket path."""


def check_token(token: str | None) -> str:
    """The token, stripped, if it is fit to guard a network listener; else a reason to pick another."""
    token = (token or "").strip()
    hint = "generate one with `openssl rand -hex 32` (or `python3 -c 'import secrets; print(secrets.token_hex(32))'`)"
    if not token:
        raise TokenRejected(f"listening on TCP needs a bearer token: {hint}")
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenRejected(f"the token has {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed: {hint}")
    lowered = token.lower()
    if any(word in lowered for word in _PLACEHOLDERS) or len(set(token)) < 10:
        raise TokenRejected(f"the token looks like a placeholder or has too few distinct characters: {hint}")
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        raise TokenRejected("the token may not contain whitespace or control characters")
    return token


def read_token_file(path: Path, create: bool = False) -> str:
    """The token in ``path``, which only its owner (this process's user) may read or write.

    With ``create``, a missing file is first written with a fresh token (mode 0600, published whole
    by a hard link, so a crash never leaves a torn one). A symlink, a file others may read, one owned
    by someone else or a weak token is refused, saying what to do.
    """
    if create and not path.exists():
        _create_token_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ListenerError(f"cannot read the token file {path}: {exc.strerror} (a symlink is refused)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ListenerError(f"the token file {path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ListenerError(f"the token file {path} belongs to uid {info.st_uid}, not to the user this runs as "
                                f"(uid {os.geteuid()}): chown it, or let a fresh one be made elsewhere")
        if info.st_mode & 0o077:
            raise ListenerError(f"the token file {path} has mode {stat.S_IMODE(info.st_mode):04o}: others may read "
                                f"the token; `chmod 600 {path}` and replace the token, it may have leaked")
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise ListenerError(f"the token file {path} is over {MAX_TOKEN_FILE_BYTES} bytes: it should hold one token")
    try:
        return check_token(data.decode("utf-8"))
    except (UnicodeDecodeError, TokenRejected) as exc:
        raise TokenRejected(f"the token in {path} is not fit to guard a listener: {exc}") from None


def _create_token_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, temporary = tempfile.mkstemp(prefix=".token-", dir=path.parent)  # mkstemp makes it 0600
    try:
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fsync(fd)
        with contextlib.suppress(FileExistsError):  # another process made one first: read that one
            os.link(temporary, path)
    finally:
        os.close(fd)
        os.unlink(temporary)


class BearerAuth:
    """ASGI middleware: every HTTP request but those to ``open_paths`` needs ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: str, hint: str, open_paths: Collection[str] = ()) -> None:
        self.app = app
        self._expected = f"Bearer {check_token(token)}".encode()
        self._hint = hint
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"code": "unauthorized", "message": f"missing or wrong bearer token: {self._hint}"}})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body.encode()})

    def _authorized(self, scope: Scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)


def check_tls(cert: Path | None, key: Path | None) -> bool:
    """Whether TLS is configured; both files or neither, and they must load."""
    if (cert is None) != (key is None):
        raise ListenerError("TLS needs both --tls-cert and --tls-key")
    if cert is None or key is None:
        return False
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ListenerError(f"cannot load the TLS certificate {cert} / key {key}: {exc}") from None
    return True


def is_loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ListenerError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    return sock


def bind_private_socket(path: Path) -> socket.socket:
    """Bind ``path`` with mode 0600 from the start (no window where others could connect)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_socket():
        raise ListenerError(f"{path} exists and is not a socket: name another path, or remove it")
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale socket of a process that died
        else:
            raise SocketInUse(f"something already listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock
