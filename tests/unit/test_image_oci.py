"""OCI / docker-save import: layer order, whiteouts, and refusal of entries that would leave the tree."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from forkd.image.errors import SourceError, UnsafeArchive
from forkd.image.oci import apply_layer, import_oci


@dataclass(frozen=True)
class Entry:
    name: str
    kind: bytes = tarfile.REGTYPE
    data: bytes = b""
    link: str = ""
    mode: int = 0o644


def F(name: str, data: bytes = b"x", mode: int = 0o644) -> Entry:
    return Entry(name, data=data, mode=mode)


def D(name: str, mode: int = 0o755) -> Entry:
    return Entry(name, tarfile.DIRTYPE, mode=mode)


def L(name: str, target: str) -> Entry:
    return Entry(name, tarfile.SYMTYPE, link=target, mode=0o777)


def H(name: str, target: str) -> Entry:
    return Entry(name, tarfile.LNKTYPE, link=target)


def layer_bytes(*entries: Entry) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type, info.mode, info.linkname, info.size = e.kind, e.mode, e.link, len(e.data)
            tar.addfile(info, io.BytesIO(e.data) if e.kind == tarfile.REGTYPE else None)
    return buf.getvalue()


def apply(root: Path, *entries: Entry) -> None:
    with tarfile.open(fileobj=io.BytesIO(layer_bytes(*entries)), mode="r|*") as layer:
        apply_layer(layer, root)


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_files_dirs_links_and_modes(tmp_path: Path) -> None:
    apply(tmp_path, D("usr"), D("usr/bin"), F("usr/bin/python3.11", b"ELF", 0o755), L("usr/bin/python3", "python3.11"),
          F("usr/bin/sudo", b"su", 0o4755), H("usr/bin/python3-hard", "usr/bin/python3.11"), L("bin", "usr/bin"),
          D("tmp", 0o1777), F("./etc/hostname", b"h"))
    assert (tmp_path / "usr/bin/python3").readlink() == Path("python3.11")
    assert (tmp_path / "bin").readlink() == Path("usr/bin")
    assert stat.S_IMODE((tmp_path / "usr/bin/sudo").stat().st_mode) == 0o4755
    assert stat.S_IMODE((tmp_path / "tmp").stat().st_mode) == 0o1777
    assert (tmp_path / "usr/bin/python3-hard").stat().st_ino == (tmp_path / "usr/bin/python3.11").stat().st_ino
    assert (tmp_path / "etc/hostname").read_bytes() == b"h"


def test_later_layers_replace_and_whiteout(tmp_path: Path) -> None:
    apply(tmp_path, D("etc"), F("etc/a", b"1"), F("etc/b"), D("var"), F("var/old"), F("file-then-dir"))
    apply(tmp_path, F("etc/a", b"2"), F("etc/.wh.b"), F(".wh.var"), D("file-then-dir"), F("file-then-dir/x"))
    assert (tmp_path / "etc/a").read_bytes() == b"2"
    assert tree(tmp_path) == {"etc", "etc/a", "file-then-dir", "file-then-dir/x"}


def test_opaque_directory_hides_lower_layers_only(tmp_path: Path) -> None:
    apply(tmp_path, D("app"), F("app/old"), D("app/sub"), F("app/sub/old"), F("keep"))
    # The opaque marker comes after this layer's own entries: they must survive it.
    apply(tmp_path, D("app"), D("app/sub"), F("app/sub/new"), F("app/new"), F("app/.wh..wh..opq"))
    assert tree(tmp_path) == {"app", "app/new", "app/sub", "app/sub/new", "keep"}


def test_whiteouts_are_not_created_as_files(tmp_path: Path) -> None:
    apply(tmp_path, D("d"), F("d/.wh.nothing-below"), F("d/.wh..wh..opq"))
    assert tree(tmp_path) == {"d"}


@pytest.mark.parametrize("entry", [
    F("../escape"),
    F("a/../../escape"),
    F("/etc/passwd"),
    H("link", "../outside"),
    H("link", "/etc/passwd"),
    L("etc/link", "../../outside"),
])
def test_entries_leaving_the_tree_are_refused(tmp_path: Path, entry: Entry) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(UnsafeArchive):
        apply(root, D("etc"), entry)
    assert not (tmp_path / "escape").exists() and not (tmp_path / "outside").exists()


def test_hardlink_to_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafeArchive):
        apply(tmp_path, H("link", "not/there"))


def test_absolute_symlinks_are_followed_inside_the_tree_only(tmp_path: Path) -> None:
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    (host_dir / "passwd").write_text("host secret")
    root = tmp_path / "root"
    root.mkdir()
    # A layer's absolute symlink names a guest path; a later entry under it must stay in the tree,
    # and a later file at the link's own name replaces the link rather than writing through it.
    apply(root, L("etc", str(host_dir)), L("secret", str(host_dir / "passwd")))
    apply(root, F("etc/passwd", b"guest"), F("secret", b"replaced"))
    assert (host_dir / "passwd").read_text() == "host secret"
    assert (root / str(host_dir).lstrip("/") / "passwd").read_bytes() == b"guest"
    assert not (root / "secret").is_symlink() and (root / "secret").read_bytes() == b"replaced"


def test_whiteout_through_symlinked_parent_stays_in_the_tree(tmp_path: Path) -> None:
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    (host_dir / "precious").write_text("keep")
    root = tmp_path / "root"
    root.mkdir()
    apply(root, L("d", str(host_dir)))
    apply(root, F("d/.wh.precious"), F("d/.wh..wh..opq"))
    assert (host_dir / "precious").read_text() == "keep"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


LAYER1 = layer_bytes(D("usr"), D("usr/bin"), F("usr/bin/python3", b"py", 0o755), F("usr/bin/tool"))
LAYER2 = layer_bytes(F("usr/bin/.wh.tool"), D("srv"), F("srv/app.py", b"print(1)"))


def test_docker_save_tarball(tmp_path: Path) -> None:
    tarball = tmp_path / "image.tar"
    with tarfile.open(tarball, "w") as tar:
        _add(tar, "manifest.json", json.dumps(
            [{"Config": "c.json", "RepoTags": ["x:1"], "Layers": ["l1/layer.tar", "l2/layer.tar"]}]).encode())
        _add(tar, "l1/layer.tar", LAYER1)
        _add(tar, "l2/layer.tar", LAYER2)
    root = tmp_path / "root"
    root.mkdir()
    import_oci(tarball, root)
    assert tree(root) == {"usr", "usr/bin", "usr/bin/python3", "srv", "srv/app.py"}
    assert os.access(root / "usr/bin/python3", os.X_OK)


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    _add(tar, f"blobs/sha256/{digest}", data)
    return f"sha256:{digest}"


def test_oci_layout_with_multi_platform_index_and_gzip_layers(tmp_path: Path) -> None:
    tarball = tmp_path / "oci.tar"
    with tarfile.open(tarball, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": _blob(tar, gzip.compress(b))}
                  for b in (LAYER1, LAYER2)]
        amd64 = _blob(tar, json.dumps({"schemaVersion": 2, "layers": layers}).encode())
        arm64 = _blob(tar, json.dumps({"schemaVersion": 2, "layers": []}).encode())
        index = _blob(tar, json.dumps({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": arm64,
             "platform": {"architecture": "arm64", "os": "linux"}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": amd64,
             "platform": {"architecture": "amd64", "os": "linux"}},
        ]}).encode())
        _add(tar, "index.json", json.dumps({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": index}]}).encode())
    root = tmp_path / "root"
    root.mkdir()
    steps: list[str] = []
    import_oci(tarball, root, steps.append)
    assert tree(root) == {"usr", "usr/bin", "usr/bin/python3", "srv", "srv/app.py"}
    assert steps == ["applying layer 1/2", "applying layer 2/2"]


def test_not_an_image_tarball(tmp_path: Path) -> None:
    tarball = tmp_path / "plain.tar"
    with tarfile.open(tarball, "w") as tar:
        _add(tar, "hello.txt", b"hi")
    with pytest.raises(SourceError, match=r"neither manifest\.json"):
        import_oci(tarball, tmp_path)
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all")
    with pytest.raises(SourceError, match="docker save"):
        import_oci(tmp_path / "junk.tar", tmp_path)


def test_docker_save_with_several_images_is_refused(tmp_path: Path) -> None:
    tarball = tmp_path / "two.tar"
    with tarfile.open(tarball, "w") as tar:
        _add(tar, "manifest.json", json.dumps([{"Layers": []}, {"Layers": []}]).encode())
    with pytest.raises(SourceError, match="exactly one image"):
        import_oci(tarball, tmp_path)
