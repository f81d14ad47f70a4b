"""Clients read guest files streamed and bounded: a guest path that never ends (a symlink to /dev/zero)
cannot grow the client's memory. A real HTTP server stands in for the daemon's files route."""

from __future__ import annotations

import asyncio
import http.server
import threading
import tracemalloc
from collections.abc import Iterator

import pytest

from forkd.mcp.server import file_contains
from forkd.sdk.async_controller import AsyncController
from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.timeout(60)
CHUNK = b"\0" * 65536


class _Endless(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    served = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        prefix = b"log line\nmark" if "split" in self.path else b""
        try:
            if prefix:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(prefix), prefix))
                self.wfile.write(b"%x\r\n%s\r\n" % (len(b"er found\n"), b"er found\n"))
            while True:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                type(self).served += len(CHUNK)
        except OSError:
            return

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def controller() -> Iterator[Controller]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = Controller(url=f"http://127.0.0.1:{httpd.server_address[1]}", token="t" * 32)
    yield client
    client.close()
    httpd.shutdown()
    httpd.server_close()


def contains(controller: Controller, *args: object) -> bool:
    """The MCP tool's scan (``file_contains``), through an async client of the same daemon."""
    async def scan() -> bool:
        async with AsyncController(connection=controller.connection) as client:
            return await file_contains(client, *args)  # type: ignore[arg-type]

    return asyncio.run(scan())


def test_read_file_with_a_limit_stops_an_endless_file(controller: Controller) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ForkdError, match="holds more than 1048576 bytes") as refused:
            controller.read_file("sb-aaaaaaaaaaaa", "/tmp/zero", max_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.status == 413
    assert peak < 16 << 20, peak  # a few chunks past the limit, not the stream


def test_waiting_for_text_scans_a_bounded_stream_and_finds_a_split_marker(controller: Controller) -> None:
    tracemalloc.start()
    try:
        assert contains(controller, "sb-aaaaaaaaaaaa", "/tmp/zero", b"never there", 8 << 20) is False
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # one chunk at a time, not 8 MiB
    assert contains(controller, "sb-aaaaaaaaaaaa", "/tmp/split", b"marker found", 1 << 20) is True


def test_a_scan_stops_at_its_deadline(controller: Controller) -> None:
    """1 TiB of an endless file would take far past the module's timeout; the deadline ends it."""
    import time

    assert contains(controller, "sb-aaaaaaaaaaaa", "/tmp/zero", b"never", 1 << 40, time.monotonic() + 0.5) is False
