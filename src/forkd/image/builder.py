"""Building a guest image: kernel and busybox from Debian packages, an initramfs, a root tree with the
agent, an ext4 image, a manifest; published into the image cache only when every step succeeded.

This module is the image API the runtime and daemon use.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.image.agent import AgentPayload, current_agent
from forkd.image.apt import AptRepo, Mirror, PackageRecord, find_mirror, resolve_kernel
from forkd.image.certs import install_ca_certs
from forkd.image.errors import ImageDamaged, ImageError, ImageNotFound
from forkd.image.initramfs import build_initramfs, busybox_from_deb
from forkd.image.kernel import Module, unpack_kernel
from forkd.image.oci import import_oci
from forkd.image.rootfs import (
    copy_root,
    debootstrap_cache_path,
    debootstrap_root,
    default_disk_size_mib,
    finish_root,
    make_ext4,
)
from forkd.image.spec import ImageSpec
from forkd.image.store import (
    INITRD_FILE,
    KERNEL_FILE,
    ROOTFS_FILE,
    Image,
    image_dir,
    image_lock,
    list_images,
    load_image,
    publish,
    remove_image,
    staging,
    write_manifest,
)
from forkd.store.files import sha256_file

__all__ = ["Image", "ImageError", "ImageNotFound", "ImageSpec", "build_image", "list_images", "load_image",
           "remove_image"]

BUSYBOX_PACKAGE = "busybox-static"
_MIB = 1024 * 1024

Progress = Callable[[str], None]


@dataclass(frozen=True)
class _Fetched:
    record: PackageRecord
    deb: Path

    @property
    def label(self) -> str:
        return f"{self.record.name}={self.record.version}"


def build_image(spec: ImageSpec, paths: Paths, progress: Progress = lambda s: None, force: bool = False) -> Image:
    """The image for ``spec``: the cached one if its key matches (and not ``force``), else a fresh build.

    A failed build leaves any previous image of the same name in place.
    """
    agent = current_agent()
    key = spec.key(agent)
    with image_lock(paths, spec.name):
        current = _existing(paths, spec.name)
        if current is not None and current.key == key and not force:
            progress(f"image {spec.name!r} is up to date (key {key[:12]})")
            return current
        started = time.monotonic()
        with staging(paths, spec.name) as staged:
            manifest = _build(spec, key, agent, paths, staged, progress)
            write_manifest(staged, manifest)
            final = image_dir(paths, spec.name)
            publish(staged, final)
    progress(f"image {spec.name!r} built in {time.monotonic() - started:.1f} s: {final}")
    return Image.from_manifest(final, manifest)


def _existing(paths: Paths, name: str) -> Image | None:
    try:
        return load_image(paths, name)
    except (ImageNotFound, ImageDamaged):
        return None


def _build(spec: ImageSpec, key: str, agent: AgentPayload, paths: Paths, staged: Path,
           progress: Progress) -> dict[str, Any]:
    """Make the image files in ``staged``; return its manifest."""
    work = staged / "work"
    with _step(progress, "finding the Debian mirror"):
        mirror = Mirror(spec.mirror.rstrip("/")) if spec.mirror else find_mirror(spec.suite)
        progress(f"mirror: {mirror.uri}")
    kernel_pkg, busybox_pkg = _fetch_packages(spec, mirror, paths, progress)
    kernel_version, modules = _make_boot_files(kernel_pkg, busybox_pkg, work, staged, progress)
    disk_size_mib = _make_rootfs(spec, mirror, agent, paths, work / "root", staged / ROOTFS_FILE, progress)
    shutil.rmtree(work)
    return {
        "name": spec.name, "key": key, "spec": spec.to_dict(), "created_at": time.time(),
        "kernel_version": kernel_version, "kernel_sha256": sha256_file(staged / KERNEL_FILE),
        "agent_version": agent.version, "disk_size_mib": disk_size_mib,
        "size_bytes": sum((staged / f).stat().st_blocks * 512 for f in (KERNEL_FILE, INITRD_FILE, ROOTFS_FILE)),
        "inputs": {
            "mirror": mirror.uri,
            "kernel_package": kernel_pkg.label, "kernel_package_sha256": kernel_pkg.record.sha256,
            "busybox_package": busybox_pkg.label, "busybox_package_sha256": busybox_pkg.record.sha256,
            "agent_sha256": agent.digest(),
            "initramfs_modules": ",".join(m.name for m in modules),
        },
    }


def _fetch_packages(spec: ImageSpec, mirror: Mirror, paths: Paths, progress: Progress) -> tuple[_Fetched, _Fetched]:
    """Download the kernel (``kernel_suite``) and busybox (``suite``) packages, reusing earlier downloads."""
    debs = paths.downloads / "debs"
    kernel_repo = AptRepo(paths.downloads / "apt" / spec.kernel_suite, mirror, spec.kernel_suite)
    base_repo = AptRepo(paths.downloads / "apt" / spec.suite, mirror, spec.suite)
    with _step(progress, f"updating the package index of {spec.kernel_suite} and {spec.suite}"):
        kernel_repo.update()
        base_repo.update()
    kernel_record = resolve_kernel(kernel_repo, spec.kernel_package)
    with _step(progress, f"downloading {kernel_record.name} {kernel_record.version}"):
        kernel = _Fetched(kernel_record, kernel_repo.download(kernel_record, debs))
    busybox_record = base_repo.record(BUSYBOX_PACKAGE)
    with _step(progress, f"downloading {busybox_record.name} {busybox_record.version}"):
        busybox = _Fetched(busybox_record, base_repo.download(busybox_record, debs))
    return kernel, busybox


def _make_boot_files(kernel_pkg: _Fetched, busybox_pkg: _Fetched, work: Path, staged: Path,
                     progress: Progress) -> tuple[str, list[Module]]:
    """Put the kernel and the initramfs into ``staged``; return the kernel release and the modules loaded."""
    with _step(progress, f"unpacking {kernel_pkg.label}"):
        kernel = unpack_kernel(kernel_pkg.deb, work / "kernel")
        os.rename(kernel.vmlinuz, staged / KERNEL_FILE)
    with _step(progress, "packing the initramfs"):
        busybox = busybox_from_deb(busybox_pkg.deb, work / "busybox")
        modules = build_initramfs(kernel.modules_dir, busybox, staged / INITRD_FILE)
        progress(f"initramfs modules: {', '.join(m.name for m in modules)}")
    return kernel.version, modules


def _make_rootfs(spec: ImageSpec, mirror: Mirror, agent: AgentPayload, paths: Paths, root: Path, image: Path,
                 progress: Progress) -> int:
    """Build the root tree in ``root`` and write it to the ext4 ``image``; return the image's size in MiB."""
    root.mkdir()
    # The guest's "/" from the start, whatever the daemon's private umask: package scripts that run
    # as another user during the install (PostgreSQL's initdb as postgres) must be able to enter it.
    root.chmod(0o755)
    _make_root_tree(spec, mirror, paths, root, progress)
    with _step(progress, "installing the forkd agent"):
        finish_root(root, agent)
    if spec.ca_certs:
        with _step(progress, f"adding {len(spec.ca_certs)} CA certificate(s) to the guest's trust store"):
            install_ca_certs(root, spec.ca_certs)
    requested_mib = spec.disk_size_mib or default_disk_size_mib(root)
    with _step(progress, f"writing the {requested_mib} MiB ext4 root file system"):
        make_ext4(root, image, requested_mib)
    return image.stat().st_size // _MIB  # mke2fs drops a last block group too small to hold metadata


def _make_root_tree(spec: ImageSpec, mirror: Mirror, paths: Paths, root: Path, progress: Progress) -> None:
    """Fill the empty ``root`` from the spec's source: a directory, an OCI tarball or debootstrap."""
    if spec.source_dir is not None:
        with _step(progress, f"copying the root tree {spec.source_dir}"):
            copy_root(spec.source_dir, root)
    elif spec.source_oci is not None:
        with _step(progress, f"importing {spec.source_oci}"):
            import_oci(spec.source_oci, root, progress)
    else:
        cached = debootstrap_cache_path(paths.cache / "rootfs", spec.suite, spec.root_packages)
        with _step(progress, f"making the {spec.suite} root tree"):
            debootstrap_root(root, suite=spec.suite, packages=spec.root_packages, mirror=mirror, cached=cached,
                             progress=progress)


@contextmanager
def _step(progress: Progress, what: str) -> Iterator[None]:
    """Report ``what`` when it starts and how long it took when it is done."""
    progress(f"{what}...")
    started = time.monotonic()
    yield
    progress(f"{what}: done in {time.monotonic() - started:.1f} s")
