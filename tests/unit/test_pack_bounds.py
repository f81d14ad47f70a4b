"""Packs as the trust boundary they are: declared sizes held to the snapshot's meta and to the free
space before a byte is written, network pulls pinned by a SHA-256, partial outputs of a killed pack
removed at startup. Real store, real archives, real HTTP; the bombs are zstd frames built by hand
(RLE blocks), so a 64 GiB member costs a 2 MiB file.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import http.server
import io
import json
import os
import struct
import tarfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zstandard

from forkd.config import Paths
from forkd.daemon.config import load_config
from forkd.hostpaths import HostRoots
from forkd.packs import archive
from forkd.packs.format import PackError, layer_digest
from forkd.packs.transfer import UrlPolicy
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.runtime import Runtime
from forkd.store.errors import DiskFull
from forkd.vmm.fake import FakeVmm

from store_helpers import MEMORY_BYTES, make_runtime, make_snapshot, pack_of, run, unpack

GIB = 1 << 30
BLOCK = 128 << 10  # the largest zstd block
HUGE_FLOOR = 1 << 60  # a free-space floor no disk meets


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    return make_runtime(tmp_path / "a")


@pytest.fixture
def good_pack(runtime: Runtime, tmp_path: Path) -> Path:
    make_snapshot(runtime, "base")
    out = tmp_path / "base.tar.zst"
    pack_of(runtime, "base", out)
    return out


@pytest.fixture
def nothing_extracted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Extracting any file of a pack fails the test (and keeps a bomb off this host's disk)."""
    def refuse(*_args: object) -> str:
        raise AssertionError("a file of the pack was extracted")
    monkeypatch.setattr(archive, "_copy", refuse)


def store_state(runtime: Runtime) -> tuple[list[str], list[str]]:
    return (sorted(p.name for p in runtime.paths.snapshots.iterdir()),
            sorted(r.tag for r in runtime.registry.list_snapshots()))


Member = tuple[tarfile.TarInfo, bytes]


def members_of(pack: Path) -> list[Member]:
    with open(pack, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as z, \
            tarfile.open(fileobj=z, mode="r|") as tar:
        return [(info, tar.extractfile(info).read()) for info in tar]  # type: ignore[union-attr]


def tar_bytes(members: list[Member], close: bool = True) -> bytes:
    buffer = io.BytesIO()
    tar = tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT)
    for info, data in members:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    if close:
        tar.close()
    return buffer.getvalue()


def write_pack(path: Path, members: list[Member]) -> Path:
    path.write_bytes(zstandard.ZstdCompressor().compress(tar_bytes(members)))
    return path


def reseal(members: list[Member], files: dict[str, bytes] | None = None,
           meta_change: Callable[[dict], None] = lambda _m: None) -> list[Member]:
    """The one-snapshot pack ``members`` with ``base/<name>`` replaced by ``files`` and its meta changed,
    every digest and size recomputed: consistent, so only the new checks can refuse it."""
    files = {f"base/{name}": data for name, data in (files or {}).items()}
    members = [(info, files.get(info.name, data)) for info, data in members]
    meta = json.loads(next(d for i, d in members if i.name == "base/meta.json"))
    for info, data in members:
        if info.name.startswith("base/") and info.name != "base/meta.json":
            meta["sha256"][info.name.removeprefix("base/")] = hashlib.sha256(data).hexdigest()
    meta_change(meta)
    raw_meta = json.dumps(meta).encode()
    members = [(info, raw_meta if info.name == "base/meta.json" else data) for info, data in members]
    manifest = json.loads(members[0][1])
    entry = manifest["snapshots"][0]
    entry["files"] = [{"name": info.name.removeprefix("base/"), "size": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()} for info, data in members[1:]]
    entry["digest"] = layer_digest(meta["sha256"])
    return [(members[0][0], json.dumps(manifest).encode()), *members[1:]]


def zstd_frame(pieces: list[bytes | tuple[int, int]]) -> bytes:
    """One zstd frame of raw blocks (bytes) and RLE blocks (``(byte, count)``): 4 bytes per 128 KiB of a run."""
    blocks: list[tuple[int, int, bytes]] = []  # (type, size, content)
    for piece in pieces:
        if isinstance(piece, bytes):
            blocks += [(0, len(piece[i:i + BLOCK]), piece[i:i + BLOCK]) for i in range(0, len(piece), BLOCK)]
        else:
            byte, count = piece
            blocks += [(1, min(BLOCK, count - i), bytes([byte])) for i in range(0, count, BLOCK)]
    out = bytearray(b"\x28\xb5\x2f\xfd\x00\x38")  # magic; no content size, no checksum; 128 KiB window
    for n, (kind, size, content) in enumerate(blocks):
        header = (n == len(blocks) - 1) | kind << 1 | size << 3
        out += struct.pack("<I", header)[:3] + content
    return bytes(out)


def bomb(good: Path, out: Path, member: str, declared: int, manifest_size: int | None = None) -> Path:
    """``good`` with ``member`` holding ``declared`` bytes of 0x01 (one RLE run); the manifest lists it
    with ``manifest_size`` (default: ``declared``), every other member as it was."""
    members = members_of(good)
    manifest = json.loads(members[0][1])
    for item in manifest["snapshots"][0]["files"]:
        if f"base/{item['name']}" == member:
            item["size"] = declared if manifest_size is None else manifest_size
    members[0] = (members[0][0], json.dumps(manifest).encode())
    at = next(i for i, (info, _) in enumerate(members) if info.name == member)
    head = tar_bytes(members[:at], close=False)
    header = tarfile.TarInfo(member)
    header.size = declared
    head += header.tobuf(tarfile.PAX_FORMAT)
    padding = -declared % tarfile.BLOCKSIZE
    out.write_bytes(zstd_frame([head, (1, declared), bytes(padding) + tar_bytes(members[at + 1:])]))
    return out


# declared sizes ---------------------------------------------------------------------------------

def test_a_64_gib_memory_of_0x01_is_refused_before_extraction(runtime: Runtime, good_pack: Path, tmp_path: Path,
                                                              nothing_extracted: None) -> None:
    pack = bomb(good_pack, tmp_path / "bomb.tar.zst", "base/memory", 64 * GIB)
    assert pack.stat().st_size < 8 << 20  # a small file: 2 MiB of RLE blocks and the good members stored raw
    before = store_state(runtime)
    with pytest.raises(PackError, match=r"base/memory is declared as 68719476736 bytes, but the snapshot's guest RAM "
                                        r"is 8 MiB .*refused before extracting anything"):
        unpack(runtime, pack, tag="victim")
    assert store_state(runtime) == before


def test_a_member_running_past_its_declared_size_is_refused_at_once(runtime: Runtime, good_pack: Path,
                                                                    tmp_path: Path) -> None:
    """The tar header says 64 GiB, the manifest 50,000 bytes: refused at the header, before its data."""
    pack = bomb(good_pack, tmp_path / "state.tar.zst", "base/state", 64 * GIB, manifest_size=50_000)
    before = store_state(runtime)
    with pytest.raises(PackError, match="'base/state' holds 68719476736 bytes, the manifest says 50000"):
        unpack(runtime, pack, tag="victim")
    assert store_state(runtime) == before


@pytest.mark.parametrize(("member", "declared", "message"), [
    ("base/meta.json", 64 << 20, "base/meta.json is declared as 67108864 bytes, more than such a file can hold"),
    ("base/state", 300 << 20, "base/state is declared as 314572800 bytes, more than such a file can hold"),
])
def test_a_file_declared_larger_than_it_can_be_is_refused_unread(member: str, declared: int, message: str,
                                                                 runtime: Runtime, good_pack: Path, tmp_path: Path,
                                                                 nothing_extracted: None) -> None:
    pack = bomb(good_pack, tmp_path / "big.tar.zst", member, declared)
    before = store_state(runtime)
    with pytest.raises(PackError, match=message):
        unpack(runtime, pack, tag="victim")
    assert store_state(runtime) == before


def test_a_memory_file_other_than_the_recorded_ram_is_refused(runtime: Runtime, good_pack: Path,
                                                             tmp_path: Path) -> None:
    members = members_of(good_pack)
    memory = next(d for i, d in members if i.name == "base/memory")
    doubled = write_pack(tmp_path / "doubled.tar.zst", reseal(members, {"memory": memory + bytes(MEMORY_BYTES)}))
    before = store_state(runtime)
    with pytest.raises(PackError, match=r"base/memory is declared as 16777216 bytes, but the snapshot's guest RAM "
                                        r"is 8 MiB"):
        unpack(runtime, doubled, tag="victim")

    def boot_more(meta: dict) -> None:
        meta["boot"]["memory_mib"] = 16
    lying = write_pack(tmp_path / "lying.tar.zst", reseal(members, meta_change=boot_more))
    with pytest.raises(PackError, match="boots 16 MiB of RAM but records 8 MiB in its identity"):
        unpack(runtime, lying, tag="victim")
    assert store_state(runtime) == before


def test_a_file_no_snapshot_holds_is_refused(runtime: Runtime, good_pack: Path, tmp_path: Path) -> None:
    members = members_of(good_pack)
    extra = (tarfile.TarInfo("base/payload.bin"), b"x" * 100)
    odd = reseal([*members, extra])
    with pytest.raises(PackError, match="base/payload.bin is not a file a forkd snapshot holds"):
        unpack(runtime, write_pack(tmp_path / "odd.tar.zst", odd), tag="victim")


# pinning --------------------------------------------------------------------------------------------

class _Served:
    def __init__(self, directory: Path) -> None:
        self.requests: list[str] = []
        served = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, directory=str(directory), **kwargs)  # type: ignore[arg-type]

            def do_GET(self) -> None:
                served.requests.append(self.path)
                super().do_GET()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def served(good_pack: Path) -> Iterator[_Served]:
    """``good_pack``'s directory over real HTTP on loopback."""
    serving = _Served(good_pack.parent)
    thread = threading.Thread(target=serving.server.serve_forever, daemon=True)
    thread.start()
    yield serving
    serving.server.shutdown()
    serving.server.server_close()
    thread.join(timeout=10)


def test_a_network_pull_without_a_pin_is_refused_saying_how_to_pin(good_pack: Path, served: _Served,
                                                                   tmp_path: Path) -> None:
    other = make_runtime(tmp_path / "b")
    other.packs.urls = UrlPolicy(allow_hosts=("127.0.0.1",))
    url = f"{served.url}/{good_pack.name}"
    with pytest.raises(PackError, match=r"without a SHA-256 pin.*--sha256 HEX.*https:// index.*allow_unpinned"):
        run(other.packs.resolve(url, None, None, None, None))
    with pytest.raises(PackError, match="without a SHA-256 pin"):  # an index's digests over plain http pin nothing
        run(other.packs.resolve(None, f"{served.url}/index.json", "base", None, None))
    assert served.requests == [] and store_state(other) == ([], [])
    other.packs.allow_unpinned = True  # the operator's opt-in: then it pulls, verified by the manifest only
    source = run(other.packs.resolve(url, None, None, None, None))
    assert run(other.packs.pull(source, False, lambda _: None))["tag"] == "base"
    assert load_config(env={}).runtime_options.allow_unpinned_pulls is False  # refused unless configured
    configured = load_config(env={}, overrides={"transfers.allow_unpinned": True})
    assert configured.runtime_options.allow_unpinned_pulls is True


def test_a_pinned_pull_with_a_wrong_digest_is_refused_and_the_right_one_pulls(good_pack: Path, served: _Served,
                                                                              tmp_path: Path) -> None:
    other = make_runtime(tmp_path / "b")
    other.packs.urls = UrlPolicy(allow_hosts=("127.0.0.1",))
    url = f"{served.url}/{good_pack.name}"
    wrong = run(other.packs.resolve(url, None, None, "0" * 64, None))
    with pytest.raises(PackError, match="was advertised: refused, nothing unpacked"):
        run(other.packs.pull(wrong, False, lambda _: None))
    assert store_state(other) == ([], [])
    right = run(other.packs.resolve(url, None, None, hashlib.sha256(good_pack.read_bytes()).hexdigest(), None))
    assert run(other.packs.pull(right, False, lambda _: None))["tag"] == "base"


# the free-space floor ---------------------------------------------------------------------------------

def test_the_free_space_floor_refuses_pack_unpack_and_pull(runtime: Runtime, good_pack: Path, served: _Served,
                                                            tmp_path: Path) -> None:
    other = make_runtime(tmp_path / "b", RuntimeOptions(free_floor_bytes=HUGE_FLOOR, transfer_hosts=("127.0.0.1",)))
    make_snapshot(other, "mine")
    with pytest.raises(DiskFull, match=r"a pack of 'mine' needs up to \d+ MiB under .*\(`\[disk\] "
                                               r"min_free_mib`\).*`forkd rmi TAG`"):
        run(other.packs.pack("mine", tmp_path / "mine.tar.zst", False, lambda _: None))
    assert not list(tmp_path.glob("*mine.tar.zst*"))
    with pytest.raises(DiskFull, match="unpacking 'base' needs up to"):
        unpack(other, good_pack)
    digest = hashlib.sha256(good_pack.read_bytes()).hexdigest()
    source = run(other.packs.resolve(f"{served.url}/{good_pack.name}", None, None, digest, None))
    with pytest.raises(DiskFull, match="the download of http://127.0.0.1:.* writes under"):
        run(other.packs.pull(source, False, lambda _: None))
    assert served.requests == []  # refused before a byte was fetched
    assert store_state(other) == (["mine"], ["mine"])
    assert load_config(env={}, overrides={"disk.min_free_mib": 5}).runtime_options.free_floor_bytes == 5 << 20


def test_rest_unpack_over_the_floor_is_disk_full_before_streaming(good_pack: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from forkd.daemon.app import create_app
    other = make_runtime(tmp_path / "b", RuntimeOptions(free_floor_bytes=HUGE_FLOOR))
    api = TestClient(create_app(other), raise_server_exceptions=False)
    refused = api.post("/v1/packs/unpack", json={"path": str(good_pack), "tag": "copy"})
    assert refused.status_code == 507 and refused.json()["error"]["code"] == "disk_full"
    assert "forkd rmi" in refused.json()["error"]["message"] and store_state(other) == ([], [])


# partial outputs -------------------------------------------------------------------------------------

def test_startup_removes_partial_packs_and_keeps_everything_else(tmp_path: Path) -> None:
    home = tmp_path / "home"
    roots = HostRoots.under(home)
    (roots.packs / "team").mkdir(parents=True)
    partials = [roots.packs / ".base.tar.zst.partial-0123abcd", roots.packs / "team" / ".x.tar.zst.partial-deadbeef"]
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep")
    kept = [roots.packs / "base.tar.zst", roots.packs / "notes.partial-0123abcd",
            roots.packs / ".draft.partial-DEADBEEF", roots.packs / ".x.tar.zst.partial-deadbeef.bak",
            roots.packs / ".x.tar.zst.partial-0123"]
    for path in partials + kept:
        path.write_bytes(b"data")
    link = roots.packs / ".link.partial-0123abcd"
    link.symlink_to(outside)
    directory = roots.packs / ".dir.partial-0123abcd"
    directory.mkdir()

    async def restart() -> None:
        runtime = await Runtime.open(Paths(home=home, cache=tmp_path / "cache", socket=tmp_path / "s.sock"),
                                     FakeVmm(), RuntimeOptions(host_roots=roots))
        await runtime.start()
        await runtime.stop()
    asyncio.run(restart())
    assert [p for p in partials if p.exists()] == []
    assert all(p.exists() for p in kept) and link.is_symlink() and directory.is_dir()
    assert outside.read_bytes() == b"keep"


def test_running_out_of_space_midway_is_disk_full_and_leaves_nothing(runtime: Runtime, good_pack: Path,
                                                                    tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer may take the space after the check: ENOSPC is then disk_full, not an internal error."""
    def full(*_args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(archive, "_pwrite_all", full)
    before = store_state(runtime)
    with pytest.raises(DiskFull, match="disk full under .* while unpacking .*forkd rmi TAG"):
        unpack(runtime, good_pack, tag="copy")
    assert store_state(runtime) == before
