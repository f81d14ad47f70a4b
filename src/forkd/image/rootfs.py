"""The guest root file system: getting a tree (debootstrap, a directory or an OCI tarball), finishing
it for forkd, and turning it into a raw ext4 image.

A debootstrap run takes over a minute, so its result is cached as a tarball keyed by what
debootstrap was asked for (suite and packages), not by the mirror that served it or by the agent:
changing the agent only re-runs the fast steps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from forkd.image.agent import AgentPayload, install_agent
from forkd.image.apt import Mirror
from forkd.image.commands import run, stream
from forkd.image.errors import SourceError
from forkd.image.tree import ensure_dir_in_root, tree_usage_bytes, write_in_root

#: Bump when the debootstrap invocation changes, so cached trees made the old way are not reused.
#: 2: the root is 0755 while packages install (under 0700 their scripts running as other users failed).
DEBOOTSTRAP_FORMAT = 2
HEADROOM_MIB = 512
_MIB = 1024 * 1024
_TAR_OPTIONS = ("--numeric-owner", "--xattrs", "--xattrs-include=*")
_BASE_DIRS = {"/dev": 0o755, "/proc": 0o555, "/sys": 0o555, "/run": 0o755, "/tmp": 0o1777}
_ETC_FILES = {
    "/etc/hostname": "forkd\n",
    "/etc/hosts": "127.0.0.1\tlocalhost\n127.0.1.1\tforkd\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    "/etc/resolv.conf": "# Placeholder: forkd writes the resolver when it sets up the sandbox's network.\n",
}

Progress = Callable[[str], None]


def debootstrap_cache_path(cache_dir: Path, suite: str, packages: Sequence[str]) -> Path:
    """Where the tree debootstrap makes for ``suite`` with ``packages`` is cached."""
    identity = {"format": DEBOOTSTRAP_FORMAT, "suite": suite, "packages": sorted(set(packages))}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return cache_dir / f"debootstrap-{suite}-{digest[:16]}.tar.zst"


def debootstrap_root(dest: Path, *, suite: str, packages: Sequence[str], mirror: Mirror, cached: Path,
                     progress: Progress) -> None:
    """Fill the empty ``dest`` with a minimal Debian ``suite`` plus ``packages``, from ``cached`` if it exists."""
    if cached.is_file():
        progress(f"unpacking cached debootstrap tree {cached.name}")
        run(["tar", "--extract", "--file", cached, "--use-compress-program", "zstd", "--preserve-permissions",
             *_TAR_OPTIONS, "--directory", dest],
            hint=f"the cached tree is damaged: delete {cached} to debootstrap again")
        return
    include = [f"--include={','.join(sorted(set(packages)))}"] if packages else []
    progress(f"debootstrap {suite} from {mirror.uri} (about a minute)")
    stream(["debootstrap", "--variant=minbase", *include, suite, dest, mirror.uri],
           hint=f"check the package names and that {mirror.uri} serves {suite}; debootstrap needs root",
           on_line=lambda line: progress(f"debootstrap: {line}"))
    progress(f"saving the tree as {cached} for later builds")
    _pack(dest, cached)


def _pack(tree: Path, tarball: Path) -> None:
    """Save ``tree`` as ``tarball`` (zstd), written under a temporary name and renamed when complete."""
    tarball.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=tarball.parent, prefix=f".{tarball.name}.")
    os.close(fd)
    try:
        run(["tar", "--create", "--file", tmp, "--use-compress-program", "zstd -T0 -3", *_TAR_OPTIONS,
             "--directory", tree, "."],
            hint=f"cannot write the debootstrap cache in {tarball.parent}: check free space")
        os.replace(tmp, tarball)
    finally:
        Path(tmp).unlink(missing_ok=True)


def copy_root(source: Path, dest: Path) -> None:
    """Copy the root tree at ``source`` into the empty ``dest``, keeping owners, modes, links and xattrs."""
    if not source.is_dir():
        raise SourceError(f"{source} is not a directory: pass the root directory of a Linux system")
    run(["cp", "-a", "--", f"{source}/.", dest], hint=f"cannot copy {source}: check that it is readable")


def finish_root(root: Path, agent: AgentPayload) -> None:
    """Make ``root`` a forkd guest: the mount points the initramfs needs, basic /etc files, the agent."""
    root.chmod(0o755)  # the guest's "/": `cp -a` copies a source directory's own mode onto it
    for path, mode in _BASE_DIRS.items():
        ensure_dir_in_root(root, path, mode)
    for path, text in _ETC_FILES.items():
        write_in_root(root, path, text.encode())
    install_agent(root, agent)


def default_disk_size_mib(root: Path) -> int:
    """Capacity for an ext4 image of ``root``: its size plus 10 % for metadata plus free space for the guest."""
    return math.ceil(tree_usage_bytes(root) * 1.1 / _MIB) + HEADROOM_MIB


def make_ext4(root: Path, image: Path, size_mib: int) -> None:
    """Write ``root`` into a new raw ext4 image of ``size_mib`` MiB, without mounting anything.

    The inode tables and journal are initialised now: left lazy, the guest kernel would zero them in
    the background after boot, dirtying memory and disk in every forked child.
    """
    run(["mkfs.ext4", "-q", "-F", "-L", "forkd-root", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0",
         "-d", root, image, f"{size_mib}M"],
        hint=f"if the tree does not fit in {size_mib} MiB, pass a larger disk size or leave it unset")
