"""Built images on disk: ``paths.images/<name>/`` holding the kernel, initramfs, rootfs and ``manifest.json``.

An image is built in a hidden staging directory next to its final place and swapped in with one
``renameat2(RENAME_EXCHANGE)``, so a reader sees the old image or the new one, never a mix, and a
failed build leaves the old image untouched. Builds and removals of one name hold a lock file.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.image.errors import ImageBusy, ImageDamaged, ImageNotFound
from forkd.store.files import RENAME_EXCHANGE, fsync_dir, renameat2, write_json_atomic
from forkd.validation import ValidationError, check_tag

MANIFEST_FILE = "manifest.json"
KERNEL_FILE, INITRD_FILE, ROOTFS_FILE = "vmlinuz", "initrd.img", "rootfs.ext4"
#: Bump when the manifest's fields change meaning; older images then read as needing a rebuild.
MANIFEST_FORMAT = 1
_FILES = ("path", "kernel", "initrd", "rootfs")


@dataclass(frozen=True)
class Image:
    """A built image. ``size_bytes`` is the disk space its files take (the rootfs is sparse);
    ``disk_size_mib`` the capacity of the guest's root file system; ``inputs`` the resolved package
    versions and digests it was made from."""

    name: str
    key: str
    path: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_version: str
    kernel_sha256: str
    agent_version: str
    created_at: float
    size_bytes: int
    disk_size_mib: int
    spec: dict[str, Any]
    inputs: dict[str, str]

    @classmethod
    def from_manifest(cls, directory: Path, manifest: dict[str, Any]) -> Image:
        """The image in ``directory`` described by ``manifest`` (file paths are fixed names inside it)."""
        recorded = {f.name: manifest[f.name] for f in fields(cls) if f.name not in _FILES}
        return cls(path=directory, kernel=directory / KERNEL_FILE, initrd=directory / INITRD_FILE,
                   rootfs=directory / ROOTFS_FILE, **recorded)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, paths as strings."""
        return {k: str(v) if k in _FILES else v for k, v in asdict(self).items()}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` (every :class:`Image` field but the paths) into ``directory``."""
    write_json_atomic(directory / MANIFEST_FILE, {"format": MANIFEST_FORMAT, **manifest})


def image_dir(paths: Paths, name: str) -> Path:
    return paths.images / check_tag(name, "image name")


def load_image(paths: Paths, name: str) -> Image:
    """The built image called ``name``."""
    directory = image_dir(paths, name)
    if not directory.is_dir():
        raise ImageNotFound(f"no image {name!r} in {paths.images}: build it with `forkd image build`")
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {manifest.get('format')}, expected {MANIFEST_FORMAT}")
        image = Image.from_manifest(directory, manifest)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _damaged(name, directory, str(exc)) from exc
    missing = [p.name for p in (image.kernel, image.initrd, image.rootfs) if not p.is_file()]
    if missing:
        raise _damaged(name, directory, f"missing {', '.join(missing)}")
    return image


def _damaged(name: str, directory: Path, reason: str) -> ImageDamaged:
    return ImageDamaged(f"image {name!r} in {directory} is unusable ({reason}): "
                        f"rebuild it with `forkd image build --force`")


def list_images(paths: Paths) -> list[Image]:
    """Every usable image, by name. Staging and lock entries (dot names) and damaged images are left out."""
    if not paths.images.is_dir():
        return []
    images = []
    for entry in sorted(paths.images.iterdir()):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            images.append(load_image(paths, entry.name))
        except (ImageDamaged, ValidationError):  # damaged, or a directory forkd did not make
            continue
    return images


def remove_image(paths: Paths, name: str) -> None:
    """Delete the image ``name``; it disappears at once (renamed away), then its files are removed."""
    directory = image_dir(paths, name)
    with image_lock(paths, name):
        if not directory.is_dir():
            raise ImageNotFound(f"no image {name!r} in {paths.images}: nothing to remove")
        trash = directory.with_name(f".remove.{name}.{secrets.token_hex(4)}")
        os.rename(directory, trash)
        shutil.rmtree(trash)


@contextmanager
def image_lock(paths: Paths, name: str) -> Iterator[None]:
    """Exclusive hold on image ``name`` across processes, for as long as the block runs.

    Held already (a build takes minutes), it is :class:`ImageBusy` at once: a caller never waits for
    it on a thread, which a few waiting requests would take all of."""
    paths.images.mkdir(parents=True, exist_ok=True)
    path = paths.images / f".lock.{check_tag(name, 'image name')}"
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ImageBusy(f"image {name!r} is being built or removed by another request or process (it holds "
                            f"{path}); retry when that is done") from None
        yield


@contextmanager
def staging(paths: Paths, name: str) -> Iterator[Path]:
    """A fresh hidden directory to build image ``name`` in; removed on exit, whatever it then holds.

    Call under :func:`image_lock`: leftovers of earlier, killed builds of ``name`` are removed first.
    """
    prefix = f".build.{check_tag(name, 'image name')}."  # '.' cannot occur in a name: no prefix clashes
    for leftover in paths.images.glob(f"{prefix}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    staged = Path(tempfile.mkdtemp(prefix=prefix, dir=paths.images))
    try:
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def publish(staged: Path, final: Path) -> None:
    """Put the directory ``staged`` in place as ``final``; a previous ``final`` ends up at ``staged``."""
    staged.chmod(0o755)
    if final.exists():
        renameat2(staged, final, RENAME_EXCHANGE)
    else:
        os.rename(staged, final)
    fsync_dir(final.parent)
