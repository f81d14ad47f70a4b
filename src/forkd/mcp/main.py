"""The ``forkd-mcp`` command: serve the forkd tools over stdio (for desktop clients) or streamable HTTP."""

from __future__ import annotations

from pathlib import Path

import anyio
import click

from forkd import __version__
from forkd.listeners import ListenerError
from forkd.mcp.http import TOKEN_FILE_ENV, HttpOptions, default_token_file, open_endpoint, serve_http
from forkd.mcp.server import build_server
from forkd.mcp.terminals import Holdings
from forkd.sdk.async_controller import AsyncController

FilePath = click.Path(dir_okay=False, path_type=Path)


@click.command()
@click.version_option(__version__, package_name="forkd")
@click.option("--transport", type=click.Choice(["stdio", "http"]), default="stdio", show_default=True,
              help="stdio: a client launches forkd-mcp itself; http: streamable HTTP at http://HOST:PORT/mcp")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (http); off the loopback only with --tls-cert/--tls-key")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True, help="port (http)")
@click.option("--socket", "socket_path", type=FilePath,
              help="serve HTTP on this Unix socket (mode 0600, no token) instead of TCP")
@click.option("--token-file", type=FilePath, envvar=TOKEN_FILE_ENV, show_envvar=True,
              help="the bearer token every HTTP request must send (mode 0600; made with a fresh token if "
                   "missing) [default: $XDG_CONFIG_HOME/forkd/mcp-token]")
@click.option("--tls-cert", type=FilePath, help="TLS certificate (PEM) for the HTTP listener")
@click.option("--tls-key", type=FilePath, help="TLS private key (PEM) for the HTTP listener")
def main(transport: str, host: str, port: int, socket_path: Path | None, token_file: Path | None,
         tls_cert: Path | None, tls_key: Path | None) -> None:
    """Serve forkd sandboxes as MCP tools; the daemon is found by FORKD_URL (and FORKD_TOKEN)."""
    endpoint = None
    if transport == "http":
        options = HttpOptions(host=host, port=port, socket_path=socket_path,
                              token_file=token_file or default_token_file(), tls_cert=tls_cert, tls_key=tls_key)
        try:
            endpoint = open_endpoint(options)
        except ListenerError as exc:
            raise click.UsageError(str(exc)) from None
        guard = f"bearer token from {options.token_file}" if endpoint.token else "socket mode 0600"
        click.echo(f"forkd-mcp: serving {endpoint.url} ({guard})", err=True)

    async def serve() -> None:
        async with AsyncController() as controller:
            holdings = Holdings(controller)
            server = build_server(controller, holdings)
            try:
                if endpoint is None:
                    await server.run_stdio_async()
                else:
                    await serve_http(server, endpoint)
            finally:  # the session (stdio) or the server ended: its terminals are hung up, its watchers removed
                with anyio.CancelScope(shield=True):
                    await holdings.close()

    anyio.run(serve)
