"""Running the daemon: uvicorn serving the API on a Unix socket only its owner can open, and
optionally on TCP (always with a bearer token, optionally TLS).

Both listeners serve one app and one runtime; each request passes, outermost first, the audit log,
(on TCP) the token check and the body-size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import logging.handlers
import os
import signal
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from forkd.daemon.app import create_app
from forkd.daemon.middleware.audit import AuditLog, AuditMiddleware
from forkd.daemon.middleware.auth import TokenAuth
from forkd.daemon.middleware.body_limit import BodyLimit
from forkd.daemon.middleware.timing import ServerTiming
from forkd.daemon.config import ConfigError, DaemonConfig, Server
from forkd.daemon.lock import DaemonAlreadyRunning, HomeLock
from forkd.daemon.notify import notify
from forkd.e2b import app as e2b_app
from forkd.e2b.app import E2BFront
from forkd.e2b.keys import Credentials, CredentialsError
from forkd.e2b.storage import Storage
from forkd.listeners import (ListenerError, SocketInUse, bind_private_socket, bind_tcp, check_tls, check_token,
                             is_loopback)
from forkd.runtime.runtime import Runtime
from forkd.safetext import visible
from forkd.vmm.backends import create_vmm
from forkd.vmm.base import VmmError

log = logging.getLogger("forkd.daemon")


@dataclass(frozen=True)
class TcpListener:
    host: str
    port: int
    token: str
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def parse(cls, address: str, token: str | None, tls_cert: Path | None = None,
              tls_key: Path | None = None) -> TcpListener:
        """``HOST:PORT`` (``[v6]:PORT`` for IPv6) with a token fit for the network, and TLS files that load."""
        host, port = parse_address(address, "--listen", 7070)
        check_tls(tls_cert, tls_key)
        return cls(host=host, port=port, token=check_token(token), tls_cert=tls_cert, tls_key=tls_key)

    @classmethod
    def from_config(cls, config: DaemonConfig) -> TcpListener | None:
        """The configured listener; the token comes from ``token_file``, else ``FORKD_TOKEN``."""
        if config.listen is None:
            if config.token_file or config.tls_cert:
                raise ListenerError("token_file and tls_cert/tls_key apply to a TCP listener: set listen too")
            return None
        token = os.environ.get("FORKD_TOKEN")
        if config.token_file is not None:
            try:
                token = config.token_file.read_text()
            except OSError as exc:
                raise ListenerError(f"cannot read the token file {config.token_file}: {exc.strerror}") from None
        return cls.parse(config.listen, token, config.tls_cert, config.tls_key)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def parse_address(address: str, flag: str, example_port: int) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as host and port."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ListenerError(f"{flag} wants HOST:PORT (e.g. 127.0.0.1:{example_port}), not {address!r}")
    return host, int(port)


class HeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection that does not finish a request's head in time.

    uvicorn bounds idle keep-alive connections but not a client that opens a connection and sends
    its headers slowly (or never); many such clients would hold every connection slot.
    """

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm()  # part of a head (first request, or the next one on a kept-alive connection)
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def _server(app: object, lifespan: str, limits: Server, listener: TcpListener | None = None) -> uvicorn.Server:
    tls = {"ssl_certfile": str(listener.tls_cert), "ssl_keyfile": str(listener.tls_key)} \
        if listener is not None and listener.tls_cert is not None else {}
    return uvicorn.Server(uvicorn.Config(
        # log_config=None: uvicorn's loggers reach the daemon's handler (its file, its format) instead of stderr.
        app, log_level="warning", log_config=None, timeout_graceful_shutdown=5, lifespan=lifespan,
        http=functools.partial(HeadDeadline, header_timeout_s=limits.header_timeout_s),  # type: ignore[arg-type]
        limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=1 << 20, **tls))  # type: ignore[arg-type]


async def serve(config: DaemonConfig) -> None:
    paths = config.paths
    tcp = TcpListener.from_config(config)
    e2b_address = parse_address(config.e2b.listen, "--e2b-listen", 3000) if config.e2b.listen else None
    credentials = e2b_credentials(config) if e2b_address is not None else None
    try:  # before any socket or lock is taken: a host that cannot confine VMMs is refused here
        vmm = create_vmm(config.vmm, config.backend_options)
    except VmmError as exc:
        raise ConfigError(str(exc)) from None
    home_lock = HomeLock.acquire(paths.home, paths.socket)
    try:
        sockets = [bind_private_socket(paths.socket)]
    except SocketInUse:
        home_lock.release()
        raise DaemonAlreadyRunning(f"a forkd daemon already listens on {paths.socket}") from None
    except BaseException:
        home_lock.release()
        raise
    try:
        if tcp is not None:
            sockets.append(bind_tcp(tcp.host, tcp.port))
        if e2b_address is not None:
            sockets.append(bind_tcp(*e2b_address))
    except BaseException:
        for sock in sockets:
            sock.close()
        paths.socket.unlink(missing_ok=True)
        home_lock.release()
        raise
    for warning in config.deprecations():
        log.warning("%s", warning)
    runtime = await Runtime.open(paths, vmm, config.runtime_options)
    audit = AuditLog(paths.audit_log, max_bytes=config.audit.max_bytes, backups=config.audit.backups)
    e2b_front = E2BFront(runtime, credentials, config.e2b.domain or f"localhost:{e2b_address[1]}", Storage(
        runtime, None if config.e2b.owner_quota_mib is None else config.e2b.owner_quota_mib << 20)) \
        if e2b_address is not None and credentials is not None else None
    api = BodyLimit(create_app(runtime, [e2b_front.keeper] if e2b_front is not None else []))
    # The Unix listener runs the app's lifespan (start, and on shutdown kill every child).
    servers = [_server(ServerTiming(AuditMiddleware(api, audit, "unix")), "on", config.server)]
    if tcp is not None:
        servers.append(_server(ServerTiming(AuditMiddleware(TokenAuth(api, tcp.token), audit, "tcp")), "off",
                               config.server, tcp))
        scheme = "https" if tcp.tls_cert else "http"
        log.info("listening on %s://%s:%d (bearer token required)%s", scheme, tcp.host, tcp.port,
                 "" if tcp.loopback or tcp.tls_cert else "; WARNING: no TLS on a non-loopback address")
    if e2b_address is not None and e2b_front is not None:
        front = BodyLimit(e2b_front, is_upload=e2b_app.is_upload, is_stream=e2b_app.is_stream,
                          body_timeout_s=config.server.body_timeout_s, shape=e2b_app.refusal_shape)
        servers.append(_server(AuditMiddleware(front, audit, "e2b"), "off", config.server))
        log.info("E2B front on http://%s:%d (keys in %s)%s", *e2b_address, e2b_keys_file(config),
                 "" if is_loopback(e2b_address[0]) else "; WARNING: no TLS on a non-loopback address")
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, audit.reopen)
    try:
        tasks = [asyncio.create_task(server.serve(sockets=[sock])) for server, sock in zip(servers, sockets)]
        ready = asyncio.create_task(_notify_when_serving(servers, paths.socket))
        # uvicorn's signal handling reaches the last server started; stop the others with it.
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        notify("STOPPING=1")
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks)
    finally:
        audit.close()
        with contextlib.suppress(FileNotFoundError):
            paths.socket.unlink()
        home_lock.release()


async def _notify_when_serving(servers: list[uvicorn.Server], socket: Path) -> None:
    """``READY=1`` to systemd once every listener has run its startup (the runtime is open, sockets accept)."""
    while not all(server.started for server in servers):
        await asyncio.sleep(0.05)  # uvicorn offers no started callback; its flag is set once, then stays
    log.info("ready: serving on %s", socket)
    notify("READY=1")


def e2b_keys_file(config: DaemonConfig) -> Path:
    return config.e2b.keys_file or config.paths.home / "e2b" / "api-keys"


def e2b_credentials(config: DaemonConfig) -> Credentials:
    """The E2B front's API keys (a key file with one new key is made if the default one is missing)."""
    try:
        return Credentials.load(e2b_keys_file(config), config.paths.home / "e2b" / "token-secret",
                                create_keys=config.e2b.keys_file is None)
    except (CredentialsError, OSError) as exc:
        raise ListenerError(str(exc)) from None


def configure_logging(config: DaemonConfig) -> None:
    """stderr by default (the journal under systemd); a size-rotated file when ``log_file`` is set."""
    handler: logging.Handler = logging.StreamHandler()
    if config.log_file is not None:
        config.log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(config.log_file, maxBytes=config.log_max_bytes,
                                                       backupCount=config.log_backups)
    handler.setFormatter(JsonFormatter() if config.log_format == "json"
                         else VisibleFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    # qemu.qmp logs each failed connect at ERROR; monitor() (vmm/qemu_machine.py) retries those while QEMU
    # starts and raises an error of its own when it gives up, so they are noise in a healthy log.
    logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)


class VisibleFormatter(logging.Formatter):
    """Log lines whose guest-supplied parts (error messages, output) cannot forge lines or drive a terminal."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's naming
        return visible(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:  # noqa: N802
        # A traceback keeps its lines, each indented: an exception message's newline then cannot
        # start a line that reads as a record of its own (every record starts at column 0).
        shown = visible(super().formatException(ei), keep_newlines=True)
        return "\n".join(f"  {line}" for line in shown.split("\n"))


class JsonFormatter(logging.Formatter):
    """``log_format = "json"``: one JSON object a line, for log shippers (guest text is escaped by JSON itself)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def run(config: DaemonConfig) -> None:
    # Everything the daemon writes is private to root, started by systemd (UMask=0077) or not:
    # state.db holds sandbox environments, console logs hold guest output, RAM files guest memory.
    os.umask(0o077)
    configure_logging(config)
    asyncio.run(serve(config))
    if config.sandboxes.keep_on_stop:
        # VMMs left for the next daemon must outlive this process: leave without running
        # finalizers, since asyncio's subprocess transports kill a child still running when collected.
        logging.shutdown()
        os._exit(0)
