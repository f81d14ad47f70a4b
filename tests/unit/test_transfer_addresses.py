"""Where a pull or push may connect: public addresses only, unless the allow-list names the host; the
address is resolved once and connected to (no rebinding); a remote's answer never reaches an error
message; a download nobody gave a size for is bounded.

Requests go to a real HTTP server on loopback; name resolution is replaced (the only seam) where a
test needs a host name that answers as it says.
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd.packs import transfer
from forkd.packs.format import PackError
from forkd.packs.transfer import UrlPolicy, download, upload

pytestmark = pytest.mark.timeout(60)


class _Handler(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str, str | None]] = []  # method, path, Host header
    body = b"hello"
    put_status = 200

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.seen.append(("GET", self.path, self.headers.get("Host")))
        self.send_response(200)
        if self.path != "/endless":
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
            return
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"\x01" * 65536)
        except OSError:
            return

    def do_PUT(self) -> None:  # noqa: N802
        self.seen.append(("PUT", self.path, self.headers.get("Host")))
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        secret = b'{"AccessKeyId": "ASIA-SECRET", "Token": "instance-credentials"}'
        self.send_response(self.put_status)
        self.send_header("Content-Length", str(len(secret)))
        self.end_headers()
        self.wfile.write(secret)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def port() -> Iterator[int]:
    _Handler.seen, _Handler.put_status = [], 200
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Host name → the addresses each lookup answers in turn (the last one repeats); lookups are counted."""
    answers: dict[str, list[str]] = {}
    real = asyncio.BaseEventLoop.getaddrinfo

    async def getaddrinfo(self: Any, host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        if host not in answers:
            return await real(self, host, port, *args, **kwargs)
        queue = answers[host]
        address = queue.pop(0) if len(queue) > 1 else queue[0]
        answers.setdefault(f"{host} lookups", []).append(address)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, port))]
    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)
    return answers


def _get(url: str, tmp_path: Path, policy: UrlPolicy, size: int | None = None) -> str:
    target = tmp_path / f"download-{len(list(tmp_path.iterdir()))}"
    return asyncio.run(download(url, target, None, size, lambda _: None, policy))


@pytest.mark.parametrize("address, kind", [("127.0.0.1", "loopback"), ("169.254.169.254", "link-local"),
                                           ("10.1.2.3", "private"), ("192.168.0.7", "private"),
                                           ("100.64.0.1", "non-public"), ("::1", "loopback"),
                                           ("fe80::1", "link-local"), ("::ffff:169.254.169.254", "link-local")])
def test_a_host_resolving_to_a_non_public_address_is_refused_before_connecting(
        address: str, kind: str, resolver: dict[str, list[str]], tmp_path: Path) -> None:
    resolver["packs.example.net"] = [address]
    for policy in (UrlPolicy(), UrlPolicy(("*.example.net",))):  # a pattern does not name a host
        with pytest.raises(PackError, match=rf"resolves to .*a {kind} address.*`\[transfers\] allow_hosts`"):
            _get("http://packs.example.net/x.tar.zst", tmp_path, policy)
    with pytest.raises(PackError, match="a loopback address"):
        asyncio.run(upload(tmp_path, "http://127.0.0.1:9/up", lambda _: None))  # a literal address too


def test_a_named_host_may_be_private_and_is_connected_to_at_the_address_it_resolved_to_once(
        port: int, resolver: dict[str, list[str]], tmp_path: Path) -> None:
    """A rebinding DNS server answers one address to the check and another to the connection's own
    lookup: here the first answer is the address connected to, and no second lookup (which would
    answer 10.9.9.9) is made; the HTTP client never resolves the name itself."""
    resolver["hub.internal.test"] = ["127.0.0.1", "10.9.9.9"]
    _get(f"http://hub.internal.test:{port}/pack", tmp_path, UrlPolicy(("hub.internal.test",)))
    assert _Handler.seen == [("GET", "/pack", f"hub.internal.test:{port}")]  # sent to 127.0.0.1, named as given
    assert resolver["hub.internal.test lookups"] == ["127.0.0.1"]


def test_a_rebinding_host_is_refused_by_the_address_it_is_sent_to(resolver: dict[str, list[str]],
                                                                  tmp_path: Path) -> None:
    """An allow-listed pattern host whose second answer is private: every request resolves once and checks
    that answer; the request that would go to 169.254.169.254 is refused, never sent."""
    resolver["cdn.example.net"] = ["169.254.169.254"]
    with pytest.raises(PackError, match="169.254.169.254, a link-local address"):
        _get("http://cdn.example.net/x", tmp_path, UrlPolicy(("*.example.net",)))


def test_a_failed_push_does_not_echo_the_remotes_answer(port: int, tmp_path: Path) -> None:
    _Handler.put_status = 403
    pack = tmp_path / "p.tar.zst"
    pack.write_bytes(b"pack")
    with pytest.raises(PackError) as failed:
        asyncio.run(upload(pack, f"http://127.0.0.1:{port}/up?X-Signature=secret", lambda _: None,
                           UrlPolicy(("127.0.0.1",))))
    message = str(failed.value)
    assert "HTTP 403" in message and "presigned URL" in message
    assert "SECRET" not in message and "credentials" not in message and "X-Signature" not in message


def test_a_download_with_no_advertised_size_is_bounded(port: int, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "MAX_UNSIZED_BYTES", 1 << 20)
    with pytest.raises(PackError, match="sent more than 1048576 bytes and no size was advertised"):
        _get(f"http://127.0.0.1:{port}/endless", tmp_path, UrlPolicy(("127.0.0.1",)))


def test_peers_may_be_private_but_pulls_may_not(tmp_path: Path) -> None:
    """The cluster's nodes talk over its own network (packs/peer.py); the same policy with private_ok."""
    from store_helpers import make_runtime
    runtime = make_runtime(tmp_path)
    assert runtime.peers.urls.private_ok and not runtime.packs.urls.private_ok
    assert runtime.peers.urls.allow_hosts == runtime.packs.urls.allow_hosts
