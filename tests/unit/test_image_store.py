"""The image cache: manifests, listing, removal, atomic replacement and the up-to-date short cut."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from forkd.config import Paths
from forkd.image.builder import ImageSpec, build_image
from forkd.image.errors import ImageDamaged, ImageNotFound, ToolError
from forkd.image.store import (
    INITRD_FILE,
    KERNEL_FILE,
    MANIFEST_FILE,
    ROOTFS_FILE,
    Image,
    image_lock,
    list_images,
    load_image,
    publish,
    remove_image,
    staging,
    write_manifest,
)


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(home=tmp_path / "home", cache=tmp_path / "cache", socket=tmp_path / "forkd.sock")


def manifest(name: str, key: str = "k" * 64) -> dict[str, object]:
    return {
        "name": name, "key": key, "kernel_version": "6.12.1+deb12-cloud-amd64", "kernel_sha256": "a" * 64,
        "agent_version": "0.1.0", "created_at": 1700000000.5, "size_bytes": 12345, "disk_size_mib": 868,
        "spec": ImageSpec(name=name).to_dict(), "inputs": {"mirror": "http://mirror.example.test/debian"},
    }


def make_image(paths: Paths, name: str, key: str = "k" * 64, marker: str = "old") -> Path:
    directory = paths.images / name
    directory.mkdir(parents=True)
    for f in (KERNEL_FILE, INITRD_FILE, ROOTFS_FILE):
        (directory / f).write_text(marker)
    write_manifest(directory, manifest(name, key))
    return directory


def test_manifest_round_trip(paths: Paths) -> None:
    directory = make_image(paths, "default")
    image = load_image(paths, "default")
    assert image == Image.from_manifest(directory, manifest("default"))
    assert image.rootfs == directory / ROOTFS_FILE and image.kernel == directory / KERNEL_FILE
    as_dict = image.to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert as_dict["initrd"] == str(directory / INITRD_FILE)
    on_disk = json.loads((directory / MANIFEST_FILE).read_text())
    assert on_disk["format"] == 1 and "path" not in on_disk  # relocatable: no absolute paths stored


def test_unknown_image_tells_how_to_build_it(paths: Paths) -> None:
    with pytest.raises(ImageNotFound, match="forkd image build"):
        load_image(paths, "nothing")
    assert issubclass(ImageNotFound, LookupError)


def test_damaged_images(paths: Paths) -> None:
    directory = make_image(paths, "broken")
    (directory / ROOTFS_FILE).unlink()
    with pytest.raises(ImageDamaged, match=r"missing rootfs\.ext4.*--force"):
        load_image(paths, "broken")
    (directory / MANIFEST_FILE).write_text(json.dumps({"format": 0}))
    with pytest.raises(ImageDamaged, match="manifest format"):
        load_image(paths, "broken")


def test_list_skips_hidden_and_damaged_entries(paths: Paths) -> None:
    make_image(paths, "b")
    make_image(paths, "a")
    (make_image(paths, "c") / MANIFEST_FILE).unlink()
    (paths.images / ".build.x.123").mkdir()
    (paths.images / "not a name").mkdir()
    assert [i.name for i in list_images(paths)] == ["a", "b"]


def test_list_without_cache_is_empty(paths: Paths) -> None:
    assert list_images(paths) == []


def test_remove_image(paths: Paths) -> None:
    make_image(paths, "gone")
    remove_image(paths, "gone")
    assert not (paths.images / "gone").exists()
    assert [p.name for p in paths.images.iterdir()] == [".lock.gone"]
    with pytest.raises(ImageNotFound):
        remove_image(paths, "gone")


def test_publish_swaps_in_the_new_image_and_staging_cleans_up(paths: Paths) -> None:
    final = make_image(paths, "default", marker="old")
    (paths.images / ".build.default.stale").mkdir()      # a killed earlier build of this name
    (paths.images / ".build.default-2.other").mkdir()    # another name's build: not ours to remove
    with image_lock(paths, "default"), staging(paths, "default") as staged:
        assert not (paths.images / ".build.default.stale").exists()
        (staged / ROOTFS_FILE).write_text("new")
        publish(staged, final)
        assert (staged / ROOTFS_FILE).read_text() == "old"  # the previous image, about to be removed
    assert (final / ROOTFS_FILE).read_text() == "new"
    assert sorted(p.name for p in paths.images.iterdir()) == [".build.default-2.other", ".lock.default", "default"]


def test_up_to_date_image_is_returned_without_building(paths: Paths) -> None:
    spec = ImageSpec(mirror="file:///nonexistent/debian")  # any build attempt would fail
    make_image(paths, "default", key=spec.key())
    lines: list[str] = []
    image = build_image(spec, paths, lines.append)
    assert image == load_image(paths, "default")
    assert lines == [f"image 'default' is up to date (key {spec.key()[:12]})"]


def test_failed_build_keeps_the_old_image_and_leaves_nothing_behind(paths: Paths) -> None:
    spec = ImageSpec(mirror="file:///nonexistent/debian")
    make_image(paths, "default", key=spec.key())
    lines: list[str] = []
    with pytest.raises(ToolError, match="check the mirror"):
        build_image(spec, paths, lines.append, force=True)
    assert load_image(paths, "default").key == spec.key()
    assert (paths.images / "default" / ROOTFS_FILE).read_text() == "old"
    assert sorted(p.name for p in paths.images.iterdir()) == [".lock.default", "default"]
    assert lines[0] == "finding the Debian mirror..."


def test_package_scripts_can_enter_the_root_tree_under_a_private_umask(paths: Paths, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon runs with umask 077; a root tree made 0700 let no package script running as
    another user (PostgreSQL's initdb as ``postgres``) start, so the image had no database cluster."""
    from forkd.image import builder

    modes: list[int] = []

    def fill(spec: ImageSpec, mirror: object, paths: Paths, root: Path, progress: object) -> None:
        modes.append(root.stat().st_mode & 0o777)
        raise ToolError("stop here")

    monkeypatch.setattr(builder, "_make_root_tree", fill)
    old = os.umask(0o077)
    try:
        with pytest.raises(ToolError):
            builder._make_rootfs(ImageSpec(), None, None, paths, tmp_path / "root", tmp_path / "rootfs.ext4",
                                 lambda line: None)
    finally:
        os.umask(old)
    assert modes == [0o755]
