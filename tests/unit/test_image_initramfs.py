"""Kernel module resolution and the initramfs archive, from a fake kernel module tree."""

from __future__ import annotations

import gzip
import io
import lzma
import re
import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from forkd.image.errors import KernelError
from forkd.image.initramfs import CpioEntry, build_initramfs, init_script, write_newc
from forkd.image.kernel import Module, modinfo, modules_to_load, read_module

VERSION = "6.12.1+deb12-cloud-amd64"


def fake_module(name: str, depends: str = "") -> bytes:
    """A minimal ELF64 object with a ``.modinfo`` section, as the kernel build writes it."""
    info = f"license=GPL\0depends={depends}\0name={name}\0vermagic={VERSION}\0".encode()
    names = b"\0.modinfo\0.shstrtab\0"
    shoff = 64 + len(info) + len(names)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)

    def section(name_offset: int, offset: int, size: int) -> bytes:
        entry = bytearray(64)
        struct.pack_into("<I", entry, 0, name_offset)
        struct.pack_into("<QQ", entry, 0x18, offset, size)
        return bytes(entry)

    return bytes(header) + info + names + section(0, 0, 0) + section(1, 64, len(info)) + \
        section(10, 64 + len(info), len(names))


@pytest.fixture
def modules_dir(tmp_path: Path) -> Path:
    """virtio_blk standalone; virtio_net -> net_failover -> failover; vsock transport chain; virtio_mmio (microvm's
    transport); virtio built in."""
    root = tmp_path / "lib" / "modules" / VERSION
    layout = {
        "drivers/block/virtio_blk.ko.xz": ("virtio_blk", ""),
        "drivers/net/virtio_net.ko.xz": ("virtio_net", "net_failover"),
        "drivers/net/net_failover.ko.gz": ("net_failover", "failover"),
        "net/core/failover.ko": ("failover", ""),
        "net/vmw_vsock/vmw_vsock_virtio_transport.ko.xz": ("vmw_vsock_virtio_transport",
                                                           "vmw_vsock_virtio_transport_common,vsock"),
        "net/vmw_vsock/vmw_vsock_virtio_transport_common.ko.xz": ("vmw_vsock_virtio_transport_common", "vsock"),
        "net/vmw_vsock/vsock.ko.xz": ("vsock", ""),
        "drivers/virtio/virtio_mmio.ko.xz": ("virtio_mmio", ""),
    }
    compress = {".xz": lzma.compress, ".gz": gzip.compress, ".ko": bytes}
    for rel, (name, depends) in layout.items():
        path = root / "kernel" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(compress[path.suffix](fake_module(name, depends)))
    (root / "modules.builtin").write_text("kernel/drivers/virtio/virtio.ko\nkernel/drivers/virtio/virtio_pci.ko\n")
    return root


def test_modinfo_reads_depends(modules_dir: Path) -> None:
    data = read_module(modules_dir / "kernel/drivers/net/virtio_net.ko.xz")
    assert modinfo(data, "virtio_net")["depends"] == "net_failover"
    assert modinfo(data, "virtio_net")["name"] == "virtio_net"


def test_modinfo_refuses_non_elf() -> None:
    with pytest.raises(KernelError, match="not a 64-bit"):
        modinfo(b"MZ\0\0", "bogus")


def test_unsupported_compression_is_explained(tmp_path: Path) -> None:
    (tmp_path / "x.ko.zst").write_bytes(b"")
    with pytest.raises(KernelError, match="xz and gzip"):
        read_module(tmp_path / "x.ko.zst")


def test_dependencies_load_first_and_builtins_are_skipped(modules_dir: Path) -> None:
    modules = modules_to_load(modules_dir, ["virtio_blk", "virtio"], ["virtio-net", "vmw_vsock_virtio_transport"])
    assert [(m.name, m.required) for m in modules] == [
        ("virtio_blk", True),
        ("failover", False), ("net_failover", False), ("virtio_net", False),
        ("vsock", False), ("vmw_vsock_virtio_transport_common", False), ("vmw_vsock_virtio_transport", False),
    ]
    assert modules[0].data == fake_module("virtio_blk")  # stored uncompressed


def test_dependency_of_required_module_is_required(modules_dir: Path) -> None:
    modules = modules_to_load(modules_dir, ["virtio_net"], ["failover"])
    assert [(m.name, m.required) for m in modules] == [("failover", True), ("net_failover", True),
                                                       ("virtio_net", True)]


def test_missing_module_names_the_kernel(modules_dir: Path) -> None:
    with pytest.raises(KernelError, match=re.escape(f"kernel {VERSION} has no module nvme")):
        modules_to_load(modules_dir, ["nvme"], [])


def read_newc(data: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """Parse a newc archive independently of the writer: name -> (mode, data, rdev)."""
    entries, pos = {}, 0
    while True:
        assert data[pos:pos + 6] == b"070701"
        fields = [int(data[pos + 6 + 8 * i:pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rdev, namesize = fields[1], fields[6], (fields[9], fields[10]), fields[11]
        name = data[pos + 110:pos + 110 + namesize - 1].decode()
        pos += 110 + namesize + (-(110 + namesize) % 4)
        body = data[pos:pos + size]
        pos += size + (-size % 4)
        if name == "TRAILER!!!":
            assert pos == len(data)
            return entries
        entries[name] = (mode, body, rdev)


def test_newc_round_trip_with_padding() -> None:
    buf = io.BytesIO()
    write_newc([CpioEntry("a", stat.S_IFREG | 0o644, b"12345"), CpioEntry("dir", stat.S_IFDIR | 0o755),
                CpioEntry("dev/null", stat.S_IFCHR | 0o666, rdev=(1, 3))], buf)
    assert len(buf.getvalue()) % 4 == 0
    assert read_newc(buf.getvalue()) == {
        "a": (stat.S_IFREG | 0o644, b"12345", (0, 0)),
        "dir": (stat.S_IFDIR | 0o755, b"", (0, 0)),
        "dev/null": (stat.S_IFCHR | 0o666, b"", (1, 3)),
    }


@pytest.fixture
def initrd(modules_dir: Path, tmp_path: Path) -> tuple[Path, list[Module]]:
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"\x7fELF busybox")
    out = tmp_path / "initrd.img"
    return out, build_initramfs(modules_dir, busybox, out)


def test_initramfs_contents(initrd: tuple[Path, list[Module]]) -> None:
    out, modules = initrd
    entries = read_newc(out.read_bytes())
    assert entries["dev/console"] == (stat.S_IFCHR | 0o600, b"", (5, 1))
    assert entries["bin/busybox"] == (stat.S_IFREG | 0o755, b"\x7fELF busybox", (0, 0))
    assert entries["init"][0] == stat.S_IFREG | 0o755
    for directory in ("bin", "dev", "lib/modules", "newroot", "proc", "sys"):
        assert stat.S_ISDIR(entries[directory][0])
    shipped = {name.removeprefix("lib/modules/").removesuffix(".ko"): body
               for name, (_, body, _) in entries.items() if name.startswith("lib/modules/") and name.endswith(".ko")}
    assert shipped == {m.name: m.data for m in modules}
    assert {"virtio_blk", "virtio_net", "net_failover", "failover", "vsock", "virtio_mmio"} <= shipped.keys()


def test_initramfs_is_reproducible(initrd: tuple[Path, list[Module]], modules_dir: Path, tmp_path: Path) -> None:
    out, _ = initrd
    again = tmp_path / "again.img"
    build_initramfs(modules_dir, tmp_path / "busybox", again)
    assert again.read_bytes() == out.read_bytes()


@pytest.mark.skipif(shutil.which("cpio") is None, reason="cpio not installed")
def test_cpio_tool_reads_the_archive(initrd: tuple[Path, list[Module]]) -> None:
    out, _ = initrd
    listing = subprocess.run(["cpio", "-it"], stdin=out.open("rb"), capture_output=True, text=True, check=True)
    assert {"init", "bin/busybox", "dev/console", "lib/modules/virtio_blk.ko"} <= set(listing.stdout.split())


def test_init_script_loads_in_order_and_mounts_root(initrd: tuple[Path, list[Module]]) -> None:
    out, modules = initrd
    script = read_newc(out.read_bytes())["init"][1].decode()
    assert script.startswith("#!/bin/busybox sh\n")
    loads = [line for line in script.splitlines() if line.startswith("insmod ")]
    assert [line.split()[1] for line in loads] == [f"/lib/modules/{m.name}.ko" for m in modules]
    assert 'fail "cannot load kernel module virtio_blk"' in loads[0]
    assert all("warning" in line for line in loads[1:])  # network and vsock are optional
    for step in ("mount -t devtmpfs devtmpfs /dev", "root=/dev/vda", 'mount -t ext4 -o rw "$root" /newroot',
                 "exec switch_root /newroot /sbin/forkd-init", "poweroff -f"):
        assert step in script


def test_init_script_is_valid_shell(tmp_path: Path) -> None:
    script = tmp_path / "init"
    script.write_text(init_script([Module("virtio_blk", b"", True), Module("virtio_net", b"", False)]))
    subprocess.run(["sh", "-n", str(script)], check=True)
