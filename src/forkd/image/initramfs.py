"""The guest's initramfs: busybox, the virtio modules the kernel lacks, and an ``/init`` that mounts the root.

The archive is written here in the ``newc`` cpio format rather than with ``cpio``: it needs a
``/dev/console`` node (the kernel opens it for PID 1 before anything is mounted), which only root
could create on disk, and writing it directly makes it byte-for-byte reproducible. It stays
uncompressed: it is small, and decompressing it would cost boot time under TCG.
"""

from __future__ import annotations

import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from forkd.image.agent import GUEST_INIT
from forkd.image.apt import extract_deb
from forkd.image.errors import KernelError
from forkd.image.kernel import Module, modules_to_load

#: Modules the guest cannot boot without: the root disk's driver.
ROOT_MODULES = ("virtio_blk",)
#: Loaded when present, for devices the VMM may add: networking, vsock, and the virtio-mmio transport
#: (QEMU's microvm machine has no PCI: its devices sit on virtio-mmio, found through its ACPI tables;
#: on q35 the module finds no device and does nothing).
EXTRA_MODULES = ("virtio_net", "vmw_vsock_virtio_transport", "virtio_mmio")
ROOT_DEVICE = "/dev/vda"
ROOT_WAIT_S = 10
_DIRS = ("bin", "dev", "lib", "lib/modules", "newroot", "proc", "sys")
_CONSOLE = (5, 1)


@dataclass(frozen=True)
class CpioEntry:
    """One archive member; ``data`` is a file's content or a symlink's target."""

    name: str
    mode: int
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def write_newc(entries: Iterable[CpioEntry], out: BinaryIO) -> None:
    """Write ``entries`` and the trailer as a ``newc`` (SVR4, no checksum) cpio archive."""
    for ino, entry in enumerate([*entries, CpioEntry("TRAILER!!!", 0)], start=1):
        name = entry.name.encode() + b"\0"
        nlink = 2 if stat.S_ISDIR(entry.mode) else 1
        fields = (ino, entry.mode, 0, 0, nlink, 0, len(entry.data), 0, 0, *entry.rdev, len(name), 0)
        header = b"070701" + b"".join(b"%08X" % value for value in fields)
        out.write(header + name + _padding(len(header) + len(name)))
        out.write(entry.data + _padding(len(entry.data)))


def _padding(length: int) -> bytes:
    return b"\0" * (-length % 4)


def build_initramfs(modules_dir: Path, busybox: Path, out: Path) -> list[Module]:
    """Write the initramfs to ``out``; return the modules it loads, in load order."""
    modules = modules_to_load(modules_dir, ROOT_MODULES, EXTRA_MODULES)
    entries = [
        *(CpioEntry(d, stat.S_IFDIR | 0o755) for d in _DIRS),
        CpioEntry("dev/console", stat.S_IFCHR | 0o600, rdev=_CONSOLE),
        CpioEntry("bin/busybox", stat.S_IFREG | 0o755, busybox.read_bytes()),
        *(CpioEntry(f"lib/modules/{m.name}.ko", stat.S_IFREG | 0o644, m.data) for m in modules),
        CpioEntry("init", stat.S_IFREG | 0o755, init_script(modules).encode()),
    ]
    with open(out, "wb") as f:
        write_newc(entries, f)
    return modules


def busybox_from_deb(deb: Path, dest: Path) -> Path:
    """Unpack the ``busybox-static`` package ``deb`` under ``dest`` and return its binary."""
    extract_deb(deb, dest)
    for candidate in (dest / "bin" / "busybox", dest / "usr" / "bin" / "busybox"):
        if candidate.is_file():
            return candidate
    raise KernelError(f"{deb.name} has no busybox binary: the initramfs needs the busybox-static package")


def init_script(modules: Sequence[Module]) -> str:
    """The initramfs ``/init``: load ``modules``, mount the root disk, hand PID 1 to the forkd agent."""
    loads = "\n".join(
        f'insmod /lib/modules/{m.name}.ko || fail "cannot load kernel module {m.name}"' if m.required else
        f'insmod /lib/modules/{m.name}.ko || echo "forkd-initramfs: warning: cannot load {m.name}" >&2'
        for m in modules
    )
    return _INIT_TEMPLATE.format(loads=loads, root=ROOT_DEVICE, wait_s=ROOT_WAIT_S, tenths=ROOT_WAIT_S * 10,
                                 init=GUEST_INIT)


_INIT_TEMPLATE = """\
#!/bin/busybox sh
# forkd initramfs: load the virtio drivers the kernel has as modules, mount the root disk
# and hand over to the forkd agent. Kernel arguments: root=/dev/... picks the disk;
# forkd.shell opens a rescue shell on failure instead of powering off.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

fail() {{
    echo "forkd-initramfs: $*" >&2
    case " $(cat /proc/cmdline) " in
        *" forkd.shell "*) echo "forkd-initramfs: rescue shell; exit it to power off" >&2; setsid cttyhack sh ;;
        *) echo "forkd-initramfs: powering off (boot with forkd.shell for a rescue shell)" >&2 ;;
    esac
    poweroff -f
}}

root={root}
for arg in $(cat /proc/cmdline); do
    case "$arg" in root=/dev/*) root="${{arg#root=}}" ;; esac
done

{loads}

tries=0
while [ ! -b "$root" ]; do
    [ "$tries" -ge {tenths} ] && fail "no disk $root after {wait_s} s: attach the image's rootfs as a virtio-blk disk"
    sleep 0.1
    tries=$((tries + 1))
done
mount -t ext4 -o rw "$root" /newroot || fail "cannot mount $root (ext4) on /newroot: is it the image's rootfs.ext4?"
for fs in dev proc sys; do
    mount --move "/$fs" "/newroot/$fs" || fail "cannot move /$fs into the root file system"
done
echo "forkd-initramfs: root $root mounted, starting {init}"
exec switch_root /newroot {init}
"""
