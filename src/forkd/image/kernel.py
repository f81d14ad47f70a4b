"""The guest kernel: unpacking a Debian kernel package and working out which modules to load.

The Debian cloud kernel builds the virtio core in but ships the disk and network drivers as
compressed modules. The package carries no ``modules.dep`` (depmod runs at install time, and the
host need not have kmod), so dependencies are read from each module's own ``.modinfo`` section.
"""

from __future__ import annotations

import gzip
import lzma
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from forkd.image.apt import extract_deb
from forkd.image.errors import KernelError

_DECOMPRESS: dict[str, Callable[[bytes], bytes]] = {
    ".ko": bytes,
    ".xz": lzma.decompress,
    ".gz": gzip.decompress,
}


@dataclass(frozen=True)
class KernelTree:
    """An unpacked kernel package: the bootable image, its release string and its module tree."""

    vmlinuz: Path
    version: str
    modules_dir: Path


@dataclass(frozen=True)
class Module:
    """A loadable module, uncompressed, and whether the guest cannot boot without it."""

    name: str
    data: bytes
    required: bool


def unpack_kernel(deb: Path, dest: Path) -> KernelTree:
    """Unpack ``deb`` under ``dest`` and locate its kernel image and modules."""
    extract_deb(deb, dest)
    images = sorted((dest / "boot").glob("vmlinuz-*"))
    if len(images) != 1:
        raise KernelError(f"{deb.name} has {len(images)} kernels in /boot, expected one: "
                          f"pass a linux-image package (e.g. linux-image-cloud-amd64) as the kernel")
    version = images[0].name.removeprefix("vmlinuz-")
    for modules_dir in (dest / "lib" / "modules" / version, dest / "usr" / "lib" / "modules" / version):
        if modules_dir.is_dir():
            return KernelTree(vmlinuz=images[0], version=version, modules_dir=modules_dir)
    raise KernelError(f"{deb.name} has no modules for {version}: pass a linux-image package with modules")


def modules_to_load(modules_dir: Path, required: Sequence[str], optional: Sequence[str]) -> list[Module]:
    """The modules behind ``required`` and ``optional`` names, each after its dependencies.

    Names built into the kernel need nothing. A dependency of a required module is required.
    """
    builtin = _builtin_names(modules_dir)
    files = {_canonical(p.name): p for p in modules_dir.rglob("*.ko*")}
    chosen: dict[str, Module] = {}
    visiting: set[str] = set()

    def visit(name: str, is_required: bool) -> None:
        name = _canonical(name)
        if name in builtin or name in chosen:
            return
        if name in visiting:
            raise KernelError(f"module {name} depends on itself: the kernel package is broken")
        if name not in files:
            raise KernelError(f"kernel {modules_dir.name} has no module {name}: use a kernel that has it")
        visiting.add(name)
        data = read_module(files[name])
        for dep in filter(None, modinfo(data, name).get("depends", "").split(",")):
            visit(dep, is_required)
        chosen[name] = Module(name=name, data=data, required=is_required)

    for name in required:
        visit(name, True)
    for name in optional:
        visit(name, False)
    return list(chosen.values())


def read_module(path: Path) -> bytes:
    """The uncompressed ELF object of a ``.ko``, ``.ko.xz`` or ``.ko.gz`` file."""
    decompress = _DECOMPRESS.get(_suffix(path.name))
    if decompress is None:
        raise KernelError(f"{path.name}: only uncompressed, xz and gzip modules are supported")
    return decompress(path.read_bytes())


def modinfo(elf: bytes, name: str) -> dict[str, str]:
    """The ``key=value`` strings of a module's ``.modinfo`` section (first value of each key)."""
    if elf[:6] != b"\x7fELF\x02\x01":
        raise KernelError(f"module {name} is not a 64-bit little-endian ELF object")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(index: int) -> tuple[int, int, int]:
        base = shoff + index * shentsize
        (name_offset,) = struct.unpack_from("<I", elf, base)
        offset, size = struct.unpack_from("<QQ", elf, base + 0x18)
        return name_offset, offset, size

    _, strings, _ = section(shstrndx)
    for index in range(shnum):
        name_offset, offset, size = section(index)
        if elf[strings + name_offset:].startswith(b".modinfo\0"):
            info: dict[str, str] = {}
            for entry in elf[offset:offset + size].split(b"\0"):
                key, sep, value = entry.decode(errors="replace").partition("=")
                if sep:
                    info.setdefault(key, value)
            return info
    return {}


def _builtin_names(modules_dir: Path) -> set[str]:
    listing = modules_dir / "modules.builtin"  # one path per line, e.g. kernel/drivers/virtio/virtio.ko
    if not listing.is_file():
        return set()
    return {_canonical(line.rsplit("/", 1)[-1]) for line in listing.read_text().split()}


def _suffix(filename: str) -> str:
    """``.ko`` for an uncompressed module, else the compression suffix after it."""
    return filename.partition(".ko")[2] or ".ko"


def _canonical(filename: str) -> str:
    """Module name as the kernel knows it: no ``.ko*`` suffix, dashes as underscores."""
    return filename.partition(".ko")[0].replace("-", "_")
