"""The disk-format seam (vmm/disk.py): what a disk layer arriving in a pack may refer to, checked by
the backend that would follow the reference (QEMU's qcow2 is covered through real packs in
test_packs.py; here the rule itself and the fake's format)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from forkd.vmm.disk import UnsafeDisk, require_in_chain
from forkd.vmm.fake import FakeDisk

ANCESTORS = {"base": {"vmlinuz", "base.ext4", "disk.fake", "memory"}}


@pytest.mark.parametrize("reference", ["base.ext4", "../base/disk.fake", "../base/base.ext4"])
def test_a_layer_may_lie_over_its_own_files_and_its_ancestors(tmp_path: Path, reference: str) -> None:
    require_in_chain(tmp_path / "disk.fake", reference, {"base.ext4", "state"}, ANCESTORS)


@pytest.mark.parametrize("reference", ["/etc/passwd", "../other/disk.fake", "../base/secret", "../../x/y",
                                       "sub/disk.fake", "../base/../base/disk.fake", ""])
def test_anything_else_is_refused_naming_the_reference(tmp_path: Path, reference: str) -> None:
    with pytest.raises(UnsafeDisk, match="may only be backed by a file of its own snapshot"):
        require_in_chain(tmp_path / "disk.fake", reference, {"base.ext4", "state"}, ANCESTORS)


def test_the_fake_format_checks_the_reference_its_disks_record(tmp_path: Path) -> None:
    disk = FakeDisk()
    layer = tmp_path / "layer"
    layer.mkdir()
    (tmp_path / "frozen").write_bytes(b"fake disk over x\nwritten")
    asyncio.run(disk.export_layer(tmp_path / "frozen", layer / "disk.fake", "../base/disk.fake"))
    assert (layer / "disk.fake").read_bytes() == b"fake disk over ../base/disk.fake\nwritten"
    disk.check_packed(layer / "disk.fake", {"disk.fake"}, ANCESTORS)
    (layer / "disk.fake").write_bytes(b"fake disk over /etc/passwd\n")
    with pytest.raises(UnsafeDisk, match="'/etc/passwd'"):
        disk.check_packed(layer / "disk.fake", {"disk.fake"}, ANCESTORS)
    (layer / "disk.fake").write_bytes(b"QFI\xfb")
    with pytest.raises(UnsafeDisk, match="not a fake disk"):
        disk.check_packed(layer / "disk.fake", {"disk.fake"}, ANCESTORS)
    (layer / "state").write_bytes(b"anything")  # only its disks refer to files
    disk.check_packed(layer / "state", {"disk.fake", "state"}, ANCESTORS)
