"""Serving the forkd tools over streamable HTTP, guarded like the daemon's own TCP listener.

``forkd-mcp`` runs as the daemon's user (root) to reach its 0600 socket, so whoever reaches its
endpoint runs code in every sandbox. On TCP every request therefore needs the bearer token kept in a
0600 file (made with a fresh token on first start); an address off the loopback needs TLS too; on
loopback the SDK's DNS-rebinding guard checks Host and Origin against the very address bound (its
own default covers only 127.0.0.1, localhost and ::1). A Unix socket needs no token: its mode
(0600) admits only its owner.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

from forkd.listeners import (
    ASGIApp,
    BearerAuth,
    ListenerError,
    SocketInUse,
    bind_private_socket,
    bind_tcp,
    check_tls,
    is_loopback,
    read_token_file,
)

MCP_PATH = "/mcp"
TOKEN_FILE_ENV = "FORKD_MCP_TOKEN_FILE"


def default_token_file() -> Path:
    """``$XDG_CONFIG_HOME/forkd/mcp-token`` (``~/.config/forkd/mcp-token``): the serving user's own."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "forkd" / "mcp-token"


@dataclass(frozen=True)
class HttpOptions:
    """Where to listen and what guards it, as the operator asked."""

    host: str = "127.0.0.1"
    port: int = 8765
    socket_path: Path | None = None  # serve on this Unix socket (0600) instead of TCP
    token_file: Path = field(default_factory=default_token_file)
    tls_cert: Path | None = None
    tls_key: Path | None = None


@dataclass
class Endpoint:
    """A bound listener and what guards it; ``token`` is None only on a Unix socket."""

    sock: socket.socket
    url: str
    token: str | None
    security: TransportSecuritySettings
    tls: dict[str, str]


def open_endpoint(options: HttpOptions) -> Endpoint:
    """Check the options, read (or make) the token and bind; a refusal says what to change."""
    tls = check_tls(options.tls_cert, options.tls_key)
    tls_files = {"ssl_certfile": str(options.tls_cert), "ssl_keyfile": str(options.tls_key)} if tls else {}
    if options.socket_path is not None:
        if tls:
            raise ListenerError("--tls-cert/--tls-key apply to TCP, not to --socket")
        try:
            sock = bind_private_socket(options.socket_path)
        except SocketInUse as exc:
            raise ListenerError(f"{exc}: is another forkd-mcp serving there?") from None
        return Endpoint(sock, f"unix:{options.socket_path} (path {MCP_PATH})", None,
                        TransportSecuritySettings(enable_dns_rebinding_protection=False), {})
    loopback = is_loopback(options.host)
    if not loopback and not tls:
        raise ListenerError(f"{options.host} is not a loopback address: serving MCP there needs TLS "
                            "(--tls-cert and --tls-key), or listen on 127.0.0.1, or use --socket")
    token = read_token_file(options.token_file, create=True)
    sock = bind_tcp(options.host, options.port)
    port = sock.getsockname()[1]
    scheme = "https" if tls else "http"
    url = f"{scheme}://{_authority(options.host)}:{port}{MCP_PATH}"
    if not loopback:  # names clients use for a public address are unknown here; the token and TLS guard it
        return Endpoint(sock, url, token, TransportSecuritySettings(enable_dns_rebinding_protection=False), tls_files)
    return Endpoint(sock, url, token, rebinding_guard(options.host, port, scheme), tls_files)


def rebinding_guard(host: str, port: int, scheme: str) -> TransportSecuritySettings:
    """Host and Origin must name the loopback address bound (and ``localhost`` for 127.0.0.1 and ::1)
    with its port: a page served from any other name, rebound to this address, is refused."""
    names = {_authority(host)}
    if host in ("localhost", "127.0.0.1", "::1"):
        names |= {"localhost", _authority("127.0.0.1" if host == "localhost" else host)}
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=sorted(f"{name}:{port}" for name in names),
        allowed_origins=sorted(f"{scheme}://{name}:{port}" for name in names))


def _authority(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def http_app(server: MCPServer, endpoint: Endpoint) -> ASGIApp:
    """The SDK's streamable-HTTP app behind the endpoint's guards."""
    app = server.streamable_http_app(streamable_http_path=MCP_PATH, transport_security=endpoint.security)
    if endpoint.token is None:
        return app
    return BearerAuth(app, endpoint.token, "send `Authorization: Bearer <token>` with the token from "
                                           "forkd-mcp's token file (--token-file)")


async def serve_http(server: MCPServer, endpoint: Endpoint) -> None:
    config = uvicorn.Config(http_app(server, endpoint), log_level="warning", **endpoint.tls)  # type: ignore[arg-type]
    await uvicorn.Server(config).serve(sockets=[endpoint.sock])
