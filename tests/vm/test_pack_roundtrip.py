"""Packs on real guests: pack the session snapshot, unpack it (same daemon and a clean second one), fork
from what was unpacked; push to and pull from an HTTP server the test runs on 127.0.0.1.
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.packs.index import add_to_index
from forkd.sdk.controller import Controller, ForkdError
from forkd.store.files import sha256_file
from conftest import start_daemon, stop_daemon, vm_env_for

pytestmark = pytest.mark.vm


class _PackServer(http.server.BaseHTTPRequestHandler):
    """Serves GET from, and stores PUT bodies into, ``root`` (like an object store's presigned URLs)."""

    root: Path

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.root / self.path.lstrip("/").split("?")[0]
        if not path.is_file():
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.end_headers()
        with open(path, "rb") as f:
            shutil.copyfileobj(f, self.wfile, 1 << 20)

    def do_PUT(self) -> None:  # noqa: N802
        remaining = int(self.headers["Content-Length"])
        with open(self.root / self.path.lstrip("/").split("?")[0], "wb") as out:
            while remaining:
                chunk = self.rfile.read(min(remaining, 1 << 20))
                if not chunk:
                    break
                out.write(chunk)
                remaining -= len(chunk)
        self.send_response(200 if remaining == 0 else 400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def work_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="forkd-packs-", dir="/var/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def server(work_dir: Path) -> Iterator[str]:
    root = work_dir / "served"
    root.mkdir()
    handler = type("Handler", (_PackServer,), {"root": root})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def packed(daemon: Controller, snapshot_tag: str, forkd_home: Path) -> dict:
    # The daemon writes packs only in its packs directory (docs/security.md).
    result = daemon.pack(snapshot_tag, str(forkd_home / "packs" / "vmtest.tar.zst"))
    print(f"\npacked {result['bytes'] / 2**20:.0f} MiB of files into {result['size'] / 2**20:.1f} MiB "
          f"in {result['seconds']:.1f} s", file=sys.stderr)
    return result


def _fork_and_eval(controller: Controller, tag: str) -> None:
    result = controller.fork(tag, 1)
    assert result["errors"] == []
    sandbox = result["sandboxes"][0]["id"]
    try:
        answer = controller.eval(sandbox, "int(numpy.arange(10).sum()) + len(open('/tmp/warm-marker').read())")
        assert answer["value"] == "52", answer  # numpy warm in RAM, the warmup's file in the guest's /tmp
    finally:
        controller.kill(sandbox)


def _backing_chain(disk: Path) -> list[str]:
    out = subprocess.run(["qemu-img", "info", "--backing-chain", "--output=json", "-U", str(disk)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [Path(image["filename"]).name for image in json.loads(out)]


def test_pack_unpack_under_new_tag_forks(daemon: Controller, packed: dict, snapshot_tag: str) -> None:
    assert packed["sha256"] == sha256_file(Path(packed["path"]))
    assert [s["tag"] for s in packed["chain"]] == [snapshot_tag]
    with pytest.raises(ForkdError) as taken:
        daemon.unpack(packed["path"])
    assert taken.value.status == 409
    result = daemon.unpack(packed["path"], tag="vmtest-copy")
    try:
        assert result["tag"] == "vmtest-copy" and result["unpacked"] == ["vmtest-copy"]
        assert _backing_chain(Path(result["path"]) / "disk.qcow2") == ["disk.qcow2", "base.ext4"]
        _fork_and_eval(daemon, "vmtest-copy")
        listed = {s["tag"]: s for s in daemon.snapshots()}
        disk = listed["vmtest-copy"]["disk"]
        assert disk["physical_bytes"] < disk["logical_bytes"]  # the memory file came back sparse
    finally:
        daemon.remove_snapshot("vmtest-copy")


def test_unpack_into_a_clean_second_daemon_with_the_cli(packed: dict, daemon: Controller) -> None:
    home = Path(tempfile.mkdtemp(prefix="forkd-test-2-", dir="/var/tmp"))
    env = vm_env_for(home)
    process, second = start_daemon(home, env)
    try:
        copied = shutil.copyfile(packed["path"], home / "packs" / "vmtest.tar.zst")  # the second daemon's own
        cli = subprocess.run([sys.executable, "-m", "forkd", "unpack", str(copied)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert cli.returncode == 0, cli.stderr
        assert "snapshot vmtest ready" in cli.stdout
        images = subprocess.run([sys.executable, "-m", "forkd", "images"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert "vmtest" in images.stdout and "MiB" in images.stdout
        _fork_and_eval(second, "vmtest")
    finally:
        stop_daemon(process, second, home)
        shutil.rmtree(home, ignore_errors=True)


def _work_dirs_left(home: Path) -> list[str]:
    return [p.name for p in (home / "snapshots").iterdir() if p.name.startswith(".")]


def test_push_then_pull_through_an_index(daemon: Controller, snapshot_tag: str, server: str, work_dir: Path,
                                         packed: dict, forkd_home: Path) -> None:
    pushed = daemon.push(snapshot_tag, f"{server}/pushed.tar.zst?X-Signature=secret")
    assert "secret" not in json.dumps(pushed)  # a presigned URL's signature is never echoed
    served = work_dir / "served" / "pushed.tar.zst"
    assert sha256_file(served) == pushed["sha256"] and served.stat().st_size == pushed["size"]
    add_to_index(work_dir / "served" / "index.json", served, "vmtest-hub", "pushed.tar.zst")
    # An index over plain http pins nothing (anyone on the path could change its digests): refused, saying how.
    with pytest.raises(ForkdError, match="without a SHA-256 pin.*--sha256 HEX"):
        daemon.pull(index=f"{server}/index.json", name="vmtest-hub", tag="vmtest-pulled")
    # A local index in the packs directory pins the pack it lists, downloaded over http.
    local_index = forkd_home / "packs" / "vmtest-index.json"
    local_index.unlink(missing_ok=True)
    add_to_index(local_index, served, "vmtest-hub", f"{server}/pushed.tar.zst")
    result = daemon.pull(index=str(local_index), name="vmtest-hub", tag="vmtest-pulled")
    try:
        assert result["pack_sha256"] == pushed["sha256"] and result["tag"] == "vmtest-pulled"
        assert _work_dirs_left(forkd_home) == []
    finally:
        daemon.remove_snapshot("vmtest-pulled")
        local_index.unlink(missing_ok=True)


def test_pull_refuses_a_mismatching_advertised_hash(daemon: Controller, server: str, work_dir: Path,
                                                    packed: dict, forkd_home: Path) -> None:
    shutil.copyfile(packed["path"], work_dir / "served" / "wrong.tar.zst")
    before = {s["tag"] for s in daemon.snapshots()}
    with pytest.raises(ForkdError, match="was advertised: refused, nothing unpacked"):
        daemon.pull(f"{server}/wrong.tar.zst", sha256="ab" * 32, tag="vmtest-wrong")
    assert {s["tag"] for s in daemon.snapshots()} == before
    assert _work_dirs_left(forkd_home) == [] and not (forkd_home / "snapshots" / "vmtest-wrong").exists()


def test_a_branched_chain_unpacked_in_a_clean_daemon_forks_with_its_state_and_pins_its_base(
        daemon: Controller, snapshot_tag: str, forkd_home: Path) -> None:
    tag = "vmtest-chain"
    source = daemon.fork(snapshot_tag, 1)["sandboxes"][0]["id"]
    try:
        daemon.exec(source, "echo chained > /root/chain-disk; echo ram > /tmp/chain-ram; sync")
        assert daemon.run_code(source, "chained = 41")["error"] is None
        daemon.branch(source, tag, mode="diff")
    finally:
        daemon.kill(source)
    home = Path(tempfile.mkdtemp(prefix="forkd-test-3-", dir="/var/tmp"))
    process, clean = start_daemon(home, vm_env_for(home))
    try:
        packed = daemon.pack(tag, str(forkd_home / "packs" / "chain.tar.zst"))  # packs live in the packs dirs
        assert [s["tag"] for s in packed["chain"]] == [snapshot_tag, tag]
        result = clean.unpack(str(shutil.copyfile(packed["path"], home / "packs" / "chain.tar.zst")))
        assert result["unpacked"] == [snapshot_tag, tag] and result["parent_tag"] == snapshot_tag
        forked = clean.fork(tag, 1)
        assert forked["errors"] == []
        child = forked["sandboxes"][0]["id"]
        try:
            assert clean.exec(child, "cat /root/chain-disk /tmp/chain-ram /tmp/warm-marker")["stdout"] == \
                "chained\nram\nwarmed\n"
            assert clean.run_code(child, "chained + 1")["value"] == "42"
        finally:
            clean.kill(child)
        with pytest.raises(ForkdError) as refused:  # the unpacked layer's disk and memory sit on the base
            clean.remove_snapshot(snapshot_tag)
        assert refused.value.status == 409 and tag in str(refused.value)
        assert clean.remove_snapshot(snapshot_tag, cascade=True) == [tag, snapshot_tag]
    finally:
        stop_daemon(process, clean, home)
        shutil.rmtree(home, ignore_errors=True)
        daemon.remove_snapshot(tag)
