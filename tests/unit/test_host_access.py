"""What a token holder can make the daemon touch on its host: only files under its roots, only allowed URLs.

The REST routes are driven through the real app over a runtime configured as the daemon configures
it; downloads and index fetches go to a real HTTP server on loopback that redirects, floods or
answers as each test needs.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from forkd.config import Paths
from forkd.daemon.app import create_app
from forkd.daemon.config import load_config
from forkd.hostpaths import HostRoots, OutsideRoots
from forkd.packs.format import PackError
from forkd.packs.index import MAX_INDEX_BYTES, load_index
from forkd.packs.transfer import UrlPolicy, download
from forkd.store.registry import SnapshotRecord
from forkd.runtime.runtime import Runtime
from forkd.validation import ValidationError
from forkd.vmm.qemu import QemuVmm

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def roots(tmp_path: Path) -> HostRoots:
    made = HostRoots.under(tmp_path / "home")
    made.create()
    return made


def test_paths_outside_their_root_are_refused_saying_where_to_put_them(roots: HostRoots, tmp_path: Path) -> None:
    with pytest.raises(OutsideRoots, match=f"put the file under {roots.imports}"):
        roots.import_source(Path("/"), "source directory")
    (roots.imports / "tree").mkdir()
    assert roots.import_source(roots.imports / "tree", "source directory") == (roots.imports / "tree").resolve()
    with pytest.raises(OutsideRoots):  # .. out of the root
        roots.import_source(roots.imports / ".." / ".." / "home", "source directory")
    (roots.imports / "escape").symlink_to("/etc")
    with pytest.raises(OutsideRoots):  # a symlink out of the root
        roots.import_source(roots.imports / "escape", "source directory")
    with pytest.raises(OutsideRoots):
        roots.import_source(roots.imports, "source directory")  # the root itself is not a file in it
    with pytest.raises(ValidationError, match="does not exist"):
        roots.pack_input(roots.packs / "missing.tar.zst")
    assert roots.pack_output(roots.packs / "new.tar.zst") == roots.packs.resolve() / "new.tar.zst"
    with pytest.raises(OutsideRoots, match="pack output /etc/passwd is outside"):
        roots.pack_output(Path("/etc/passwd"))
    with pytest.raises(ValidationError, match="absolute"):
        roots.pack_output(Path("relative.tar.zst"))


def test_the_daemon_config_always_confines(tmp_path: Path) -> None:
    config = load_config(env={"FORKD_HOME": str(tmp_path)})
    assert config.runtime_options.host_roots == HostRoots(imports=tmp_path / "imports", packs=tmp_path / "packs")
    assert config.runtime_options.transfer_hosts is None
    file = tmp_path / "forkd.toml"
    file.write_text('packs_dir = "/srv/packs"\n[transfers]\nallow_hosts = ["hub.example.com", "*.example.org"]\n')
    options = load_config(file, env={}).runtime_options
    assert options.host_roots is not None and options.host_roots.packs == Path("/srv/packs")
    assert options.transfer_hosts == ("hub.example.com", "*.example.org")


def test_rest_refuses_host_paths_and_urls_a_token_should_not_reach(tmp_path: Path) -> None:
    home = tmp_path / "home"
    file = tmp_path / "forkd.toml"
    file.write_text(f'home = "{home}"\n[transfers]\nallow_hosts = ["127.0.0.1"]\n')
    config = load_config(file, env={})
    runtime = asyncio.run(Runtime.open(Paths(home=home, cache=tmp_path / "cache", socket=home / "forkd.sock"),
                                       QemuVmm(), config.runtime_options))
    api = TestClient(create_app(runtime), raise_server_exceptions=False)

    def refused(path: str, body: dict, needle: str) -> None:
        answer = api.post(path, json=body)
        assert answer.status_code == 400, (path, body, answer.text)
        assert needle in answer.json()["error"]["message"], answer.text

    imports, packs = str(home / "imports"), str(home / "packs")
    refused("/v1/images", {"name": "stolen", "source_dir": "/"}, f"put the file under {imports}")
    refused("/v1/images", {"name": "stolen", "source_oci": "/etc/shadow"}, f"put the file under {imports}")
    runtime.registry.add_snapshot(SnapshotRecord("base", "ready", "default", home / "snapshots" / "base", 1.0))
    refused("/v1/packs", {"tag": "base", "path": "/etc/cron.d/evil", "force": True}, f"put the file under {packs}")
    refused("/v1/packs/unpack", {"path": "/etc/passwd"}, f"put the file under {packs}")
    refused("/v1/packs/pull", {"url": "/etc/passwd"}, f"put the file under {packs}")
    refused("/v1/packs/pull", {"url": "file:///etc/passwd"}, f"put the file under {packs}")
    refused("/v1/packs/pull", {"index": "file:///etc/passwd", "name": "x"}, f"put the file under {packs}")
    refused("/v1/packs/pull", {"url": "http://169.254.169.254/latest/meta-data"}, "allow-list")
    refused("/v1/packs/push", {"tag": "base", "url": "https://attacker.example.net/x"}, "allow-list")
    # What the live fuzz sent: a URL the HTTP client cannot send, a token no header can carry (were 500s).
    digest = "9a" * 32
    refused("/v1/node/pull", {"digest": digest, "source": "http://o\u00e6\x85\x1d\u00a7/(\t"}, "not a valid URL")
    answer = api.post("/v1/node/pull", json={"digest": digest, "source": "http://127.0.0.1:9", "source_token": "\u00d5r"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_request", answer.text


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes | None]] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        status, headers, body = self.routes[self.path]
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if body is None:  # an endless body without a length: a client that buffers it never finishes
            chunk = b" " * 65536
            try:
                while True:
                    self.wfile.write(chunk)
            except OSError:
                return
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_redirects_are_followed_only_to_the_same_scheme_and_an_allowed_host(server: str, tmp_path: Path) -> None:
    _Handler.routes = {
        "/to-file": (302, {"Location": "file:///etc/passwd", "Content-Length": "0"}, b""),
        "/to-https": (302, {"Location": "https://127.0.0.1/x", "Content-Length": "0"}, b""),
        "/to-other-host": (302, {"Location": "http://localhost/x", "Content-Length": "0"}, b""),
        "/to-ok": (302, {"Location": "/ok", "Content-Length": "0"}, b""),
        "/ok": (200, {"Content-Length": "5"}, b"hello"),
    }
    policy = UrlPolicy(("127.0.0.1",))

    def fetch(path: str, name: str) -> str:
        return asyncio.run(download(server + path, tmp_path / name, None, None, lambda _: None, policy))

    with pytest.raises(PackError, match="another scheme"):
        fetch("/to-file", "a")
    with pytest.raises(PackError, match="another scheme"):
        fetch("/to-https", "b")
    with pytest.raises(PackError, match="allow-list"):
        fetch("/to-other-host", "c")
    fetch("/to-ok", "d")
    assert (tmp_path / "d").read_bytes() == b"hello"
    with pytest.raises(PackError, match="http"):
        UrlPolicy().check("ftp://127.0.0.1/x")


def test_an_index_body_is_refused_once_it_passes_the_limit_not_after_buffering_it(server: str) -> None:
    _Handler.routes = {
        "/endless.json": (200, {}, None),
        "/announced.json": (200, {"Content-Length": str(MAX_INDEX_BYTES + 1)}, None),
    }
    for path in ("/endless.json", "/announced.json"):
        with pytest.raises(PackError, match=f"larger than {MAX_INDEX_BYTES} bytes"):
            asyncio.run(load_index(server + path, UrlPolicy(("127.0.0.1",))))


def test_a_malformed_url_is_a_clear_refusal_not_a_crash() -> None:
    for url in ("http://[::1/x", "https://[oops", "http://host\x1d/x"):
        with pytest.raises(PackError, match="not a valid URL"):
            UrlPolicy().check(url)
