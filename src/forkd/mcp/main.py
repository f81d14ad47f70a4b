"""The ``forkd-mcp`` command: serve the forkd tools over stdio (for desktop clients) or streamable HTTP."""

from __future__ import annotations

import ipaddress

import anyio
import click

from forkd import __version__
from forkd.mcp.server import build_server
from forkd.sdk.async_controller import AsyncController

LOOPBACK_NAMES = ("localhost",)


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command()
@click.version_option(__version__, package_name="forkd")
@click.option("--transport", type=click.Choice(["stdio", "http"]), default="stdio", show_default=True,
              help="stdio: a client launches forkd-mcp itself; http: streamable HTTP at http://HOST:PORT/mcp")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (http)")
@click.option("--port", type=click.IntRange(1, 65535), default=8765, show_default=True, help="port (http)")
@click.option("--allow-remote", is_flag=True,
              help="listen on a non-loopback address: anyone who reaches it controls your sandboxes")
def main(transport: str, host: str, port: int, allow_remote: bool) -> None:
    """Serve forkd sandboxes as MCP tools; the daemon is found by FORKD_URL (and FORKD_TOKEN)."""
    if transport == "http" and not allow_remote and not _is_loopback(host):
        raise click.UsageError(f"{host} is not a loopback address and the MCP endpoint has no authentication; "
                               "pass --allow-remote if every host that can reach it may run code in your sandboxes")

    async def serve() -> None:
        async with AsyncController() as controller:
            server = build_server(controller)
            if transport == "stdio":
                await server.run_stdio_async()
            else:
                await server.run_streamable_http_async(host=host, port=port)

    anyio.run(serve)
