"""Finishing a guest root: paths resolved as the guest sees them, the agent install, the ext4 image."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from forkd.image.agent import AgentPayload, init_script, install_agent
from forkd.image.errors import SourceError
from forkd.image.rootfs import copy_root, default_disk_size_mib, finish_root, make_ext4
from forkd.image.tree import resolve_in_root, tree_fingerprint, tree_usage_bytes, write_in_root

AGENT = AgentPayload(files=(("__init__.py", b""), ("init.py", b"print('init')\n"), ("sub/x.py", b"X = 1\n")),
                     version="9.9")


def make_root(root: Path, python: str = "/usr/bin/python3.11") -> Path:
    """A usrmerged tree like Debian's: /bin and /sbin link into /usr, python3 links to python3.11."""
    for d in ("usr/bin", "usr/sbin", "usr/local/bin", "etc"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "bin").symlink_to("usr/bin")
    (root / "sbin").symlink_to("usr/sbin")
    (root / "usr/bin/dash").write_bytes(b"ELF")
    (root / "usr/bin/sh").symlink_to("dash")
    interpreter = root / python.lstrip("/")
    interpreter.write_bytes(b"ELF")
    (interpreter.parent / "python3").symlink_to(python)  # absolute, as update-alternatives makes them
    for f in (root / "usr/bin/dash", interpreter):
        f.chmod(0o755)
    return root


def test_resolve_in_root_keeps_absolute_links_and_dotdot_inside(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "link").symlink_to("/../../outside/file")
    (tmp_path / "loop").symlink_to("loop")
    assert resolve_in_root(tmp_path, "/etc/link") == tmp_path / "outside" / "file"
    assert resolve_in_root(tmp_path, "../../etc/./x") == tmp_path / "etc" / "x"
    with pytest.raises(SourceError, match="too many levels of symlinks"):
        resolve_in_root(tmp_path, "/loop/x")


def test_write_in_root_replaces_a_symlink_instead_of_following_it(tmp_path: Path) -> None:
    host_file = tmp_path / "host-resolv.conf"
    host_file.write_text("host")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "resolv.conf").symlink_to(host_file)
    write_in_root(root, "/etc/resolv.conf", b"guest")
    assert host_file.read_text() == "host"
    assert not (root / "etc/resolv.conf").is_symlink() and (root / "etc/resolv.conf").read_text() == "guest"


def test_install_agent_through_usrmerge_links(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    install_agent(root, AGENT)
    assert (root / "opt/forkd/forkd_guest/init.py").read_bytes() == b"print('init')\n"
    assert (root / "opt/forkd/forkd_guest/sub/x.py").read_bytes() == b"X = 1\n"
    init = root / "usr/sbin/forkd-init"  # /sbin is a link into /usr
    assert init.read_text() == init_script("/usr/bin/python3")
    assert stat.S_IMODE(init.stat().st_mode) == 0o755


def test_forkd_init_starts_the_agent_package(tmp_path: Path) -> None:
    script = init_script("/usr/local/bin/python3")
    assert script.startswith("#!/bin/sh\n")
    assert "PYTHONPATH=/opt/forkd exec /usr/local/bin/python3 -m forkd_guest.init" in script


def test_python_from_a_python_base_image_is_found(tmp_path: Path) -> None:
    root = tmp_path
    (root / "bin").mkdir()
    shutil.copy("/bin/sh", root / "bin" / "sh")
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "usr/local/bin/python3").write_bytes(b"ELF")
    (root / "usr/local/bin/python3").chmod(0o755)
    install_agent(root, AGENT)
    assert "/usr/local/bin/python3 -m" in (root / "sbin/forkd-init").read_text()


def test_root_without_python_is_refused_with_the_reason(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "usr/bin/python3").unlink()
    with pytest.raises(SourceError, match="the forkd agent needs python3"):
        install_agent(root, AGENT)


def test_python_link_escaping_to_the_host_does_not_count(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    (root / "usr/bin/python3").unlink()
    (root / "usr/bin/python3").symlink_to("/usr/bin/env")  # exists on the host, not in the tree
    with pytest.raises(SourceError, match="python3"):
        install_agent(root, AGENT)


def test_finish_root_prepares_mount_points_and_etc(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    root.chmod(0o700)
    finish_root(root, AGENT)
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    for d in ("dev", "proc", "sys", "run"):
        assert (root / d).is_dir()
    assert (root / "etc/hostname").read_text() == "forkd\n"
    assert "localhost" in (root / "etc/hosts").read_text()
    assert (root / "etc/resolv.conf").is_file()


def test_copy_root_keeps_links_and_modes(tmp_path: Path) -> None:
    source = make_root(tmp_path / "source")
    dest = tmp_path / "dest"
    dest.mkdir()
    copy_root(source, dest)
    assert (dest / "bin").readlink() == Path("usr/bin")
    assert os.access(dest / "usr/bin/python3.11", os.X_OK)
    with pytest.raises(SourceError, match="not a directory"):
        copy_root(tmp_path / "missing", dest)


def test_fingerprint_and_usage(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 10_000)
    os.link(tmp_path / "a", tmp_path / "b")
    first = tree_fingerprint(tmp_path)
    assert tree_usage_bytes(tmp_path) == (tmp_path / "a").stat().st_blocks * 512  # hard link counted once
    (tmp_path / "a").chmod(0o600)
    assert tree_fingerprint(tmp_path) != first


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None or shutil.which("debugfs") is None, reason="e2fsprogs missing")
def test_make_ext4_writes_the_tree(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    finish_root(root, AGENT)
    image = tmp_path / "rootfs.ext4"
    size = default_disk_size_mib(root)
    assert size >= 512
    make_ext4(root, image, size)
    assert (size - 8) * 1024 * 1024 <= image.stat().st_size <= size * 1024 * 1024  # mke2fs may drop a tiny last group
    listing = subprocess.run(["debugfs", "-R", "cat /usr/sbin/forkd-init", str(image)],
                             capture_output=True, text=True, check=True)
    assert "forkd_guest.init" in listing.stdout
