"""Small real snapshots for unit tests: laid out exactly as the store lays them out, registered in a
real registry, with real qcow2 files (qemu-img); no VM is started."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from forkd.config import Paths
from forkd.guest.protocol import AGENT_VERSION
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.runtime import Runtime
from forkd.store.files import sha256_file, write_json_atomic
from forkd.store.registry import SnapshotRecord
from forkd.vmm.base import BootSpec
from forkd.vmm.qemu import QemuVmm

MEMORY_BYTES = 8 << 20


def make_runtime(root: Path, options: RuntimeOptions | None = None) -> Runtime:
    return asyncio.run(Runtime.open(Paths(home=root / "home", cache=root / "cache", socket=root / "forkd.sock"),
                                    QemuVmm(accelerator="tcg"), options))


def qemu_img(*args: str, cwd: Path) -> None:
    subprocess.run(["qemu-img", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_snapshot(runtime: Runtime, tag: str, parent: str | None = None) -> SnapshotRecord:
    """A registered snapshot laid out like a baked one (a chain layer when ``parent`` is given)."""
    directory = runtime.paths.snapshots / tag
    directory.mkdir()
    files: list[str] = []
    if parent is None:
        (directory / "vmlinuz").write_bytes(b"kernel" + os.urandom(4096))
        (directory / "initrd.img").write_bytes(os.urandom(8192))
        with open(directory / "base.ext4", "wb") as f:
            f.truncate(4 << 20)
            f.write(os.urandom(4096))
        qemu_img("create", "-q", "-f", "qcow2", "-b", "base.ext4", "-F", "raw", "disk.qcow2", cwd=directory)
        files += ["vmlinuz", "initrd.img", "base.ext4"]
    else:
        qemu_img("create", "-q", "-f", "qcow2", "-b", f"../{parent}/disk.qcow2", "-F", "qcow2", "disk.qcow2",
                  cwd=directory)
    with open(directory / "memory", "wb") as f:  # mostly holes, like guest RAM
        f.truncate(MEMORY_BYTES)
        f.seek(1 << 20)
        f.write(os.urandom(64 * 1024))
    (directory / "state").write_bytes(os.urandom(50_000))
    files += ["disk.qcow2", "memory", "state"]
    spec = BootSpec(kernel=Path(), initrd=Path(), cmdline="", memory_mib=MEMORY_BYTES >> 20, vcpus=1,
                    kernel_sha256="k" * 64, agent_version=AGENT_VERSION)
    meta = {"identity": asdict(runtime.vmm.identity(spec)),
            "boot": {"cmdline": "", "memory_mib": MEMORY_BYTES >> 20, "vcpus": 1, "kernel_sha256": "k" * 64,
                     "agent_version": AGENT_VERSION},
            "sha256": {name: sha256_file(directory / name) for name in sorted(files)}}
    if parent is not None:
        parent_meta = runtime.registry.get_snapshot(parent).meta
        meta["parent_sha256"] = {name: parent_meta["sha256"][name] for name in ("memory", "disk.qcow2")}
    write_json_atomic(directory / "meta.json", meta)
    for name in files:
        os.chmod(directory / name, 0o400)
    record = SnapshotRecord(tag=tag, status="ready", image="default", path=directory, created_at=time.time(), meta=meta,
                            parent_tag=parent)
    runtime.registry.add_snapshot(record)
    return record


def run(coro):  # the service is async; the tests drive it directly
    return asyncio.run(coro)


def pack_of(runtime: Runtime, tag: str, out: Path) -> dict:
    return run(runtime.packs.pack(tag, out, False, lambda _: None))


def unpack(runtime: Runtime, pack: Path, tag: str | None = None, force: bool = False) -> dict:
    return run(runtime.packs.unpack(pack, tag, force, lambda _: None))


