"""Packs against a real store: real registry, real qcow2 files (qemu-img), real archives; no VM is started.

The snapshots here are laid out exactly as ``SnapshotService`` lays them out, only small; the
malicious packs are built in the test, byte for byte, from a good one.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard

from forkd.packs import archive
from forkd.packs.format import PackError, layer_digest
from forkd.packs.index import add_to_index, parse_index
from forkd.runtime.recovery import recover
from forkd.runtime.runtime import Runtime
from forkd.store.errors import SnapshotConflict
from forkd.store.files import sha256_file, write_json_atomic
from forkd.validation import ValidationError
from forkd.vmm.base import SnapshotMismatch

from store_helpers import MEMORY_BYTES, make_runtime, make_snapshot, pack_of, qemu_img, run, unpack


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    return make_runtime(tmp_path / "a")


def store_state(runtime: Runtime) -> tuple[list[str], list[str]]:
    """What a refused unpack must leave unchanged: directory entries and registered tags."""
    return (sorted(p.name for p in runtime.paths.snapshots.iterdir()),
            sorted(r.tag for r in runtime.registry.list_snapshots()))


@pytest.fixture
def good_pack(runtime: Runtime, tmp_path: Path) -> Path:
    make_snapshot(runtime, "base")
    out = tmp_path / "base.tar.zst"
    pack_of(runtime, "base", out)
    return out


def test_pack_round_trip_into_a_clean_store_keeps_files_digests_and_holes(good_pack: Path, tmp_path: Path) -> None:
    other = make_runtime(tmp_path / "b")
    result = unpack(other, good_pack)
    assert result["tag"] == "base" and result["unpacked"] == ["base"]
    record = other.registry.get_snapshot("base")
    assert record is not None and record.meta["sha256"]["memory"]
    for name, digest in record.meta["sha256"].items():
        assert sha256_file(record.path / name) == digest
    memory = (record.path / "memory").stat()
    assert memory.st_size == MEMORY_BYTES and memory.st_blocks * 512 < MEMORY_BYTES // 4  # holes stayed holes
    info = subprocess.run(["qemu-img", "info", "--backing-chain", "--output=json", str(record.path / "disk.qcow2")],
                          capture_output=True, text=True, check=True).stdout
    chain = json.loads(info)
    assert [Path(i["filename"]).name for i in chain] == ["disk.qcow2", "base.ext4"]
    other.store.open("base")  # digests and identity check out as for a fork
    assert not [p for p in other.paths.snapshots.iterdir() if p.name.startswith(".")]


def test_unpack_under_a_new_tag_and_conflicts(runtime: Runtime, good_pack: Path) -> None:
    with pytest.raises(SnapshotConflict, match="exists; unpack with --tag NEW, or --force"):
        unpack(runtime, good_pack)
    assert unpack(runtime, good_pack, tag="copy")["tag"] == "copy"
    assert {r.tag for r in runtime.registry.list_snapshots()} == {"base", "copy"}
    before = runtime.registry.get_snapshot("copy")
    replaced = unpack(runtime, good_pack, tag="copy", force=True)
    assert replaced["tag"] == "copy" and replaced["created_at"] >= before.created_at
    assert store_state(runtime) == (["base", "copy"], ["base", "copy"])
    with pytest.raises(ValidationError):
        unpack(runtime, good_pack, tag="../escape")


def test_force_refuses_to_replace_a_parent(runtime: Runtime, good_pack: Path) -> None:
    make_snapshot(runtime, "child", parent="base")
    with pytest.raises(SnapshotConflict, match="parent of child"):
        unpack(runtime, good_pack, force=True)
    assert store_state(runtime) == (["base", "child"], ["base", "child"])


def test_a_chain_packs_root_first_and_unpacks_bottom_up(runtime: Runtime, tmp_path: Path) -> None:
    make_snapshot(runtime, "base")
    make_snapshot(runtime, "layer", parent="base")
    out = tmp_path / "layer.tar.zst"
    packed = pack_of(runtime, "layer", out)
    assert [s["tag"] for s in packed["chain"]] == ["base", "layer"]
    other = make_runtime(tmp_path / "b")
    result = unpack(other, out)
    assert result["unpacked"] == ["base", "layer"] and result["parent_tag"] == "base"
    info = json.loads(subprocess.run(["qemu-img", "info", "--backing-chain", "--output=json",
                                      str(other.paths.snapshots / "layer" / "disk.qcow2")],
                                     capture_output=True, text=True, check=True).stdout)
    assert [Path(i["filename"]).parent.name + "/" + Path(i["filename"]).name for i in info] == \
        ["layer/disk.qcow2", "base/disk.qcow2", "base/base.ext4"]
    # The same chain again under a new top tag reuses the identical parent the store holds.
    again = unpack(other, out, tag="layer2")
    assert again["unpacked"] == ["layer2"] and again["reused"] == ["base"]


def test_a_chain_whose_parent_differs_in_the_store_is_refused(runtime: Runtime, tmp_path: Path) -> None:
    make_snapshot(runtime, "base")
    make_snapshot(runtime, "layer", parent="base")
    out = tmp_path / "layer.tar.zst"
    pack_of(runtime, "layer", out)
    other = make_runtime(tmp_path / "b")
    make_snapshot(other, "base")  # same tag, other content
    before = store_state(other)
    with pytest.raises(SnapshotConflict, match="ancestor 'base' differs"):
        unpack(other, out)
    assert store_state(other) == before


def test_identical_files_of_two_layers_are_stored_once(runtime: Runtime, tmp_path: Path) -> None:
    make_snapshot(runtime, "base")
    layer = make_snapshot(runtime, "layer", parent="base")
    base_dir = runtime.paths.snapshots / "base"
    os.link(base_dir / "vmlinuz", layer.path / "vmlinuz")  # a layer hard-links its parent's kernel
    meta = {**layer.meta, "sha256": {**layer.meta["sha256"], "vmlinuz": sha256_file(base_dir / "vmlinuz")}}
    os.chmod(layer.path / "meta.json", 0o600)
    write_json_atomic(layer.path / "meta.json", meta)
    out = tmp_path / "layer.tar.zst"
    pack_of(runtime, "layer", out)
    members = _members(out)
    links = [info for info, _ in members if info.islnk()]
    assert [(i.name, i.linkname) for i in links] == [("layer/vmlinuz", "base/vmlinuz")]
    other = make_runtime(tmp_path / "b")
    unpack(other, out)
    a, b = (other.paths.snapshots / "base" / "vmlinuz").stat(), (other.paths.snapshots / "layer" / "vmlinuz").stat()
    assert (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)


def test_a_corrupt_snapshot_is_not_packed(runtime: Runtime, tmp_path: Path) -> None:
    record = make_snapshot(runtime, "base")
    os.chmod(record.path / "state", 0o600)
    with open(record.path / "state", "r+b") as f:
        f.write(b"tampered")
    out = tmp_path / "base.tar.zst"
    with pytest.raises(PackError, match="state no longer matches"):
        pack_of(runtime, "base", out)
    assert list(tmp_path.glob("*base.tar.zst*")) == []


def test_index_entries_and_pull_from_a_file_url(runtime: Runtime, good_pack: Path, tmp_path: Path) -> None:
    index_file = tmp_path / "index.json"
    entry = add_to_index(index_file, good_pack, "py", "base.tar.zst", "test pack")
    assert entry.sha256 == sha256_file(good_pack) and entry.tag == "base"
    assert parse_index(index_file.read_bytes(), "index").find("py").size == good_pack.stat().st_size
    other = make_runtime(tmp_path / "b")
    source = run(other.packs.resolve(None, str(index_file), "py", None, None))
    assert source.url == good_pack.as_uri() and source.sha256 == entry.sha256
    result = run(other.packs.pull(source, False, lambda _: None))
    assert result["tag"] == "base" and result["pack_sha256"] == entry.sha256
    with pytest.raises(LookupError, match="no pack named 'nope'"):
        run(other.packs.resolve(None, str(index_file), "nope", None, None))


def test_pull_refuses_a_mismatching_advertised_digest(runtime: Runtime, good_pack: Path, tmp_path: Path) -> None:
    other = make_runtime(tmp_path / "b")
    source = run(other.packs.resolve(good_pack.as_uri(), None, None, "0" * 64, "x"))
    with pytest.raises(PackError, match="was advertised: refused, nothing unpacked"):
        run(other.packs.pull(source, False, lambda _: None))
    assert store_state(other) == ([], [])


def test_index_identity_for_another_machine_is_refused_before_download(good_pack: Path, tmp_path: Path) -> None:
    index_file = tmp_path / "index.json"
    add_to_index(index_file, good_pack, "py", "https://example.invalid/never-fetched.tar.zst")
    data = json.loads(index_file.read_text())
    data["packs"][0]["identity"]["vmm_version"] = "0.1"
    index_file.write_text(json.dumps(data))
    other = make_runtime(tmp_path / "b")
    with pytest.raises(SnapshotMismatch, match="vmm_version: saved '0.1'"):
        run(other.packs.resolve(None, str(index_file), "py", None, None))


# malicious and damaged packs ----------------------------------------------------------------------

Member = tuple[tarfile.TarInfo, bytes | None]


def _members(pack: Path) -> list[Member]:
    out: list[Member] = []
    with open(pack, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as z, \
            tarfile.open(fileobj=z, mode="r|") as tar:
        for info in tar:
            data = tar.extractfile(info).read() if info.isreg() else None
            out.append((info, data))
    return out


def _write(pack: Path, members: list[Member]) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    pack.write_bytes(zstandard.ZstdCompressor().compress(buffer.getvalue()))
    return pack


def _with_manifest(members: list[Member], change: Callable[[dict], None]) -> list[Member]:
    manifest = json.loads(members[0][1])
    change(manifest)
    return [(members[0][0], json.dumps(manifest).encode()), *members[1:]]


def _replace(members: list[Member], name: str, info: tarfile.TarInfo, data: bytes | None = None) -> list[Member]:
    return [(info, data) if m.name == name else (m, d) for m, d in members]


def _link(name: str, kind: bytes, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _evil(name: str, data: bytes = b"x") -> Member:
    return tarfile.TarInfo(name), data


def _tamper_memory(members: list[Member]) -> list[Member]:
    out = []
    for info, data in members:
        if info.name == "base/memory":
            data = bytearray(data)
            data[-1] ^= 1
            data = bytes(data)
        out.append((info, data))
    return out


def _retag(manifest: dict) -> None:
    manifest["snapshots"][0]["tag"] = "../up"


def _version(manifest: dict) -> None:
    manifest["format_version"] = 2


def _bigger(members: list[Member]) -> list[Member]:
    return [(i, d + b"\0" * 10 if i.name == "base/state" else d) for i, d in members]


def _device(members: list[Member]) -> list[Member]:
    dev = tarfile.TarInfo("base/state")
    dev.type = tarfile.CHRTYPE
    return _replace(members, "base/state", dev)


CASES: dict[str, tuple[Callable[[list[Member]], list[Member]], str]] = {
    "path traversal": (lambda m: m[:1] + [_evil("../../etc/evil")] + m[1:], "climbs out of the pack"),
    "traversal deeper": (lambda m: m[:2] + [_evil("base/../../evil")] + m[2:], "climbs out of the pack"),
    "absolute path": (lambda m: m[:1] + [_evil("/etc/evil")] + m[1:], "absolute path"),
    "symlink out": (lambda m: _replace(m, "base/vmlinuz", _link("base/vmlinuz", tarfile.SYMTYPE, "/etc/passwd")),
                    "symbolic link to '/etc/passwd', pointing out of the pack"),
    "hardlink out": (lambda m: _replace(m, "base/vmlinuz", _link("base/vmlinuz", tarfile.LNKTYPE, "/etc/passwd")),
                     "hard link to '/etc/passwd', which points out of the pack"),
    "hardlink to other content": (lambda m: _replace(m, "base/vmlinuz",
                                                     _link("base/vmlinuz", tarfile.LNKTYPE, "base/meta.json")),
                                  "whose content differs"),
    "device file": (_device, "device or FIFO"),
    "bad hash": (_tamper_memory, "base/memory: SHA-256"),
    "wrong format version": (lambda m: _with_manifest(m, _version), "format version 2 is not supported"),
    "unsafe tag": (lambda m: _with_manifest(m, _retag), "snapshots.0.tag"),
    "duplicate member": (lambda m: m[:3] + [m[2]] + m[3:], "duplicate member 'base/"),
    "extra member": (lambda m: m + [_evil("base/extra")], "'base/extra' is not listed in the manifest"),
    "oversize member": (_bigger, "holds 50010 bytes, the manifest says 50000"),
    "missing member": (lambda m: m[:-1], "ends before base/"),
    "not a manifest first": (lambda m: m[1:], "first member is not manifest.json"),
}


@pytest.mark.parametrize("case", CASES)
def test_malicious_or_damaged_packs_are_refused_leaving_nothing(case: str, runtime: Runtime, good_pack: Path,
                                                                tmp_path: Path) -> None:
    mutate, message = CASES[case]
    bad = _write(tmp_path / "bad.tar.zst", mutate(_members(good_pack)))
    before = store_state(runtime)
    with pytest.raises(PackError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        unpack(runtime, bad, tag="victim")
    assert store_state(runtime) == before
    assert not (tmp_path.parent / "etc").exists() and not Path("/etc/evil").exists()


def test_a_truncated_stream_is_refused(runtime: Runtime, good_pack: Path, tmp_path: Path) -> None:
    raw = good_pack.read_bytes()
    before = store_state(runtime)
    for cut in (len(raw) // 2, len(raw) - 200, 300):
        bad = tmp_path / "cut.tar.zst"
        bad.write_bytes(raw[:cut])
        with pytest.raises(PackError, match="truncated|not a forkd pack"):
            unpack(runtime, bad, tag="victim")
        assert store_state(runtime) == before


def test_not_a_pack_at_all(runtime: Runtime, tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar.zst"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(PackError, match="not zstd-compressed"):
        unpack(runtime, junk)


def test_more_data_than_declared_is_refused(runtime: Runtime, good_pack: Path, tmp_path: Path) -> None:
    """A zstd bomb: a huge pax header would be read into memory by tarfile; it is refused first."""
    members = _members(good_pack)
    huge = tarfile.TarInfo("base/meta.json")
    huge.pax_headers = {"comment": "x" * (200 * 1024)}
    bad = _write(tmp_path / "bomb.tar.zst", [members[0], (huge, members[1][1]), *members[2:]])
    with pytest.raises(PackError, match="extended header"):
        unpack(runtime, bad, tag="victim")


def test_a_disk_backed_by_a_host_file_is_refused(runtime: Runtime, good_pack: Path, tmp_path: Path) -> None:
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    qemu_img("create", "-q", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", "disk.qcow2", cwd=evil_dir)
    disk = (evil_dir / "disk.qcow2").read_bytes()
    members = _members(good_pack)
    digest = hashlib.sha256(disk).hexdigest()
    meta_info, meta_raw = members[1]
    meta = json.loads(meta_raw)
    meta["sha256"]["disk.qcow2"] = digest
    meta_raw = json.dumps(meta).encode()

    def fix(manifest: dict) -> None:
        entry = manifest["snapshots"][0]
        for item in entry["files"]:
            if item["name"] == "disk.qcow2":
                item.update(size=len(disk), sha256=digest)
            if item["name"] == "meta.json":
                item.update(size=len(meta_raw), sha256=hashlib.sha256(meta_raw).hexdigest())
        entry["digest"] = layer_digest(meta["sha256"])

    members = _with_manifest(members, fix)
    members[1] = (meta_info, meta_raw)
    members = [(i, disk if i.name == "base/disk.qcow2" else d) for i, d in members]
    bad = _write(tmp_path / "backing.tar.zst", members)
    before = store_state(runtime)
    with pytest.raises(PackError, match="is backed by '/etc/passwd'"):
        unpack(runtime, bad, tag="victim")
    assert store_state(runtime) == before


def test_a_pack_for_another_machine_is_refused_before_extraction(runtime: Runtime, good_pack: Path,
                                                                 tmp_path: Path) -> None:
    def other_qemu(manifest: dict) -> None:
        manifest["identity"]["accelerator"] = "kvm"

    bad = _write(tmp_path / "kvm.tar.zst", _with_manifest(_members(good_pack), other_qemu))
    with pytest.raises(SnapshotMismatch, match="accelerator: saved 'kvm', now 'tcg'"):
        unpack(runtime, bad, tag="victim")


def test_a_parent_missing_from_pack_and_store_is_refused(runtime: Runtime, tmp_path: Path) -> None:
    make_snapshot(runtime, "base")
    make_snapshot(runtime, "layer", parent="base")
    out = tmp_path / "layer.tar.zst"
    pack_of(runtime, "layer", out)
    members = _members(out)

    def drop_root(manifest: dict) -> None:
        del manifest["snapshots"][0]

    thin = [m for m in _with_manifest(members, drop_root) if not m[0].name.startswith("base/")]
    bad = _write(tmp_path / "thin.tar.zst", thin)
    other = make_runtime(tmp_path / "b")
    with pytest.raises(PackError, match="needs parent 'base', which is neither in the pack nor in the store"):
        unpack(other, bad)
    make_snapshot(other, "base")  # another 'base'
    with pytest.raises(PackError, match="parent digest differs"):
        unpack(other, bad)
    assert store_state(other) == (["base"], ["base"])
    # With the right parent in the store, the thin pack unpacks onto it.
    third = make_runtime(tmp_path / "c")
    unpack(third, out, tag="ignored")  # brings base (and layer as 'ignored')
    assert unpack(third, bad)["unpacked"] == ["layer"]


def test_an_inconsistent_chain_is_refused(runtime: Runtime, tmp_path: Path) -> None:
    make_snapshot(runtime, "base")
    make_snapshot(runtime, "layer", parent="base")
    out = tmp_path / "layer.tar.zst"
    pack_of(runtime, "layer", out)

    def wrong_parent_digest(manifest: dict) -> None:
        manifest["snapshots"][1]["parent_digest"] = "0" * 64

    bad = _write(tmp_path / "chain.tar.zst", _with_manifest(_members(out), wrong_parent_digest))
    with pytest.raises(PackError, match="chain is inconsistent"):
        unpack(make_runtime(tmp_path / "b"), bad)


def test_a_layer_recording_other_digests_for_its_parent_is_refused(runtime: Runtime, tmp_path: Path) -> None:
    """A consistent manifest whose layer's own meta.json names another parent: it would only fail at
    its first fork (snapshot_corrupt), so unpack refuses it and registers nothing."""
    make_snapshot(runtime, "base")
    make_snapshot(runtime, "layer", parent="base")
    out = tmp_path / "layer.tar.zst"
    pack_of(runtime, "layer", out)
    members = _members(out)
    [(info, raw)] = [(i, d) for i, d in members if i.name == "layer/meta.json"]
    meta = json.loads(raw)
    name = sorted(meta["parent_sha256"])[0]
    meta["parent_sha256"][name] = "0" * 64
    forged = json.dumps(meta).encode()

    def reseal(manifest: dict) -> None:
        [entry] = [f for f in manifest["snapshots"][1]["files"] if f["name"] == "meta.json"]
        entry.update(size=len(forged), sha256=hashlib.sha256(forged).hexdigest())

    bad = _write(tmp_path / "forged.tar.zst", _replace(_with_manifest(members, reseal), info.name, info, forged))
    other = make_runtime(tmp_path / "b")
    with pytest.raises(PackError, match="records other digests for its parent 'base'"):
        unpack(other, bad)
    assert store_state(other) == ([], [])


def test_stale_work_directories_are_reaped_at_start(tmp_path: Path) -> None:
    first = make_runtime(tmp_path / "a")
    (first.paths.snapshots / ".build-unpack-deadbeef" / "x").mkdir(parents=True)
    make_snapshot(first, "kept")
    first.registry.close()
    second = make_runtime(tmp_path / "a")
    assert asyncio.run(recover(second.sandboxes, second.store)).removed_builds == [".build-unpack-deadbeef"]
    assert sorted(p.name for p in first.paths.snapshots.iterdir()) == ["kept"]


def test_sparse_writer_leaves_aligned_zero_blocks_as_holes(tmp_path: Path) -> None:
    data = bytes(archive.HOLE_BLOCK * 3) + b"x" * 100 + bytes(archive.HOLE_BLOCK * 4)
    target = tmp_path / "f"
    digest = archive._copy(iter([data[:70000], data[70000:]]), target, len(data), archive.Meter(lambda _: None, "", 1))
    assert target.read_bytes() == data and digest == hashlib.sha256(data).hexdigest()
    assert target.stat().st_blocks * 512 <= 2 * archive.HOLE_BLOCK


@pytest.mark.parametrize(("document", "message"), [
    (b"not json", "is not JSON"),
    (b'{"format": "other"}', "is not a forkd-index document"),
    (b'{"format": "forkd-index", "format_version": 9}', "format version 9 is not supported"),
    (b'{"format": "forkd-index", "format_version": 1, "packs": [{"name": "../x", "tag": "t", "url": "u", '
     b'"sha256": "00", "size": 1, "identity": {}}]}', "packs.0.name"),
])
def test_bad_indexes_are_refused(document: bytes, message: str) -> None:
    with pytest.raises(PackError, match=message):
        parse_index(document, "test")


def test_rest_routes_refuse_before_streaming(runtime: Runtime, good_pack: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from forkd.daemon.app import create_app
    api = TestClient(create_app(runtime), raise_server_exceptions=False)
    assert api.post("/v1/packs", json={"tag": "missing", "path": str(tmp_path / "x.tar.zst")}).status_code == 404
    taken = api.post("/v1/packs", json={"tag": "base", "path": str(good_pack)})
    assert taken.status_code == 400 and "pass --force" in taken.json()["error"]["message"]
    assert api.post("/v1/packs/unpack", json={"path": str(good_pack)}).status_code == 409
    assert api.post("/v1/packs/unpack", json={"path": "relative.tar.zst"}).status_code == 400
    assert api.post("/v1/packs/pull", json={"url": str(good_pack), "index": str(good_pack), "name": "x"}).status_code == 400
    assert api.post("/v1/packs/push", json={"tag": "base", "url": "file:///tmp/x"}).status_code == 400
    with runtime.store.claim("held", "compacted"):  # another request is making "held": 409, nothing streamed
        busy = api.post("/v1/packs/unpack", json={"path": str(good_pack), "tag": "held"})
        assert busy.status_code == 409 and "being compacted" in busy.json()["error"]["message"]
    lines = api.post("/v1/packs/unpack", json={"path": str(good_pack), "tag": "rest-copy"}).text.splitlines()
    assert json.loads(lines[-1])["result"]["tag"] == "rest-copy"
    assert any("progress" in json.loads(line) for line in lines[:-1])
    listed = {s["tag"]: s for s in api.get("/v1/snapshots").json()["snapshots"]}
    assert listed["rest-copy"]["disk"]["physical_bytes"] < listed["rest-copy"]["disk"]["logical_bytes"]


def test_cli_index_add_and_pull_usage(good_pack: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from forkd.cli.main import cli
    index_file = tmp_path / "hub" / "index.json"
    index_file.parent.mkdir()
    runner = CliRunner()
    added = runner.invoke(cli, ["index", "add", str(index_file), str(good_pack), "--name", "py", "--url", "base.tar.zst"])
    assert added.exit_code == 0, added.output
    assert parse_index(index_file.read_bytes(), "hub").find("py").sha256 == sha256_file(good_pack)
    refused = runner.invoke(cli, ["index", "add", str(index_file), str(index_file), "--name", "x", "--url", "u"])
    assert refused.exit_code != 0 and "not zstd-compressed" in refused.output
    # Refused before any daemon is contacted (FORKD_URL points nowhere, so a contact would fail otherwise).
    usage = runner.invoke(cli, ["pull", "no-such-name"], env={"FORKD_INDEX": "", "FORKD_URL": "unix:///nonexistent"})
    assert usage.exit_code == 2 and "--index FILE_OR_URL" in usage.output


def _pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n"
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length = len(str(length)) + len(body)
    return f"{length}{body}".encode()


def test_a_stream_larger_than_its_manifest_declares_is_refused(runtime: Runtime, good_pack: Path,
                                                              tmp_path: Path) -> None:
    """Headers tarfile consumes without yielding a member still count against the declared volume."""
    members = _members(good_pack)
    padding = []
    for i in range(400):  # 400 x 60 KiB global headers: more than the pack's files and headers together
        info = tarfile.TarInfo(f"pad{i}")
        info.type = tarfile.XGLTYPE
        padding.append((info, _pax_record("comment", "x" * 60_000)))
    bad = _write(tmp_path / "padded.tar.zst", [members[0], *padding, *members[1:]])
    before = store_state(runtime)
    with pytest.raises(PackError, match="more data than its manifest declares"):
        unpack(runtime, bad, tag="victim")
    assert store_state(runtime) == before
