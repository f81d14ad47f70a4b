"""Choosing the Debian mirror from apt sources, and the apt plumbing that needs no network."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from forkd.image.apt import (
    AptRepo,
    AptSource,
    Mirror,
    PackageRecord,
    choose_mirror,
    find_mirror,
    parse_deb822,
    parse_one_line,
    read_sources,
    resolve_kernel,
)
from forkd.image.errors import MirrorNotFound

ARCHIVE = "http://mirror.example.test/debian"
SECURITY = "http://mirror.example.test/debian-security"
VENDOR = "https://vendor.example.test/apt"

DEB822 = f"""\
# the main archive
Types: deb
URIs: {ARCHIVE}/
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: {SECURITY}
Suites: bookworm-security
Components: main

Types: deb
URIs: http://disabled.example.test/debian
Suites: bookworm
Components: main
Enabled: no
"""


def test_one_line_entries_with_options_and_comments() -> None:
    text = f"""
# deb {ARCHIVE} sid main
deb [arch=amd64,arm64 signed-by=/etc/keys/vendor.gpg] {VENDOR} bookworm main  # trailing comment
deb-src {ARCHIVE} bookworm main
deb {SECURITY} bookworm-security main non-free-firmware
"""
    vendor, src, security = parse_one_line(text)
    assert vendor == AptSource(types=("deb",), uris=(VENDOR,), suites=("bookworm",), components=("main",),
                               signed_by="/etc/keys/vendor.gpg", architectures=("amd64", "arm64"))
    assert src.types == ("deb-src",)
    assert security.components == ("main", "non-free-firmware")


def test_deb822_stanzas_skip_disabled_ones() -> None:
    archive, security = parse_deb822(DEB822)
    assert archive.uris == (f"{ARCHIVE}/",)
    assert archive.suites == ("bookworm", "bookworm-updates")
    assert archive.signed_by == "/usr/share/keyrings/debian-archive-keyring.gpg"
    assert security.suites == ("bookworm-security",)


def test_deb822_inline_key_keeps_its_lines() -> None:
    text = f"Types: deb\nURIs: {ARCHIVE}\nSuites: bookworm\nComponents: main\n" \
           "Signed-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n abc\n -----END PGP PUBLIC KEY BLOCK-----\n"
    (source,) = parse_deb822(text)
    assert source.signed_by == "\n-----BEGIN PGP PUBLIC KEY BLOCK-----\n.\nabc\n-----END PGP PUBLIC KEY BLOCK-----"


def test_mirror_is_the_bookworm_main_archive_not_security_nor_updates(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(DEB822)
    mirror = find_mirror("bookworm", tmp_path)
    assert mirror == Mirror(ARCHIVE, "/usr/share/keyrings/debian-archive-keyring.gpg")


def test_read_sources_reads_list_and_sources_files_only(tmp_path: Path) -> None:
    parts = tmp_path / "sources.list.d"
    parts.mkdir()
    (tmp_path / "sources.list").write_text(f"deb {SECURITY} bookworm-security main\n")
    (parts / "extra.list").write_text(f"deb {VENDOR} bookworm main\n")
    (parts / "debian.sources").write_text(DEB822)
    (parts / "old.list.disabled").write_text(f"deb {ARCHIVE}-old bookworm main\n")
    uris = [s.uris[0] for s in read_sources(tmp_path)]
    assert uris == [SECURITY, VENDOR, f"{ARCHIVE}/", SECURITY]


def test_debian_archive_preferred_over_third_party_bookworm_main() -> None:
    sources = parse_one_line(f"deb {VENDOR} bookworm main\ndeb {ARCHIVE} bookworm main\n")
    assert choose_mirror(sources, "bookworm").uri == ARCHIVE


def test_sources_for_other_architectures_are_skipped() -> None:
    sources = parse_one_line(f"deb [arch=arm64] {ARCHIVE} bookworm main\n")
    with pytest.raises(MirrorNotFound):
        choose_mirror(sources, "bookworm")


@pytest.mark.parametrize("text", [
    "",
    f"deb {SECURITY} bookworm-security main\n",
    f"deb {ARCHIVE} bookworm contrib\n",
    f"deb-src {ARCHIVE} bookworm main\n",
    "deb cdrom:[Debian]/ bookworm main\n",
])
def test_no_usable_source_says_what_to_do(text: str) -> None:
    with pytest.raises(MirrorNotFound, match=r"--mirror URL or add a Debian source to /etc/apt/sources.list"):
        choose_mirror(parse_one_line(text), "bookworm")


def test_missing_apt_directory_means_no_mirror(tmp_path: Path) -> None:
    with pytest.raises(MirrorNotFound):
        find_mirror("bookworm", tmp_path / "nothing")


class _FakeRepo:
    def __init__(self, records: dict[str, PackageRecord]) -> None:
        self.records = records

    def record(self, package: str) -> PackageRecord:
        return self.records[package]


def _record(name: str, depends: str = "") -> PackageRecord:
    return PackageRecord(name=name, version="6.12.1-1", filename=f"pool/main/l/{name}_6.12.1-1_amd64.deb",
                         size=1, sha256="0" * 64, depends=depends)


def test_meta_package_resolves_to_versioned_kernel() -> None:
    real = _record("linux-image-6.12.1+deb12-cloud-amd64",
                   depends="kmod, initramfs-tools (>= 0.120) | linux-initramfs-tool")
    meta = _record("linux-image-cloud-amd64", depends=f"{real.name} (= 6.12.1-1)")
    repo = _FakeRepo({meta.name: meta, real.name: real})
    assert resolve_kernel(repo, meta.name) == real  # type: ignore[arg-type]
    assert resolve_kernel(repo, real.name) == real  # type: ignore[arg-type]


def test_matching_previous_download_is_reused_without_apt(tmp_path: Path) -> None:
    deb = tmp_path / "pkg_1.0_amd64.deb"
    deb.write_bytes(b"deb contents")
    record = PackageRecord(name="pkg", version="1.0", filename="pool/main/p/pkg_1.0_amd64.deb", size=12,
                           sha256=hashlib.sha256(b"deb contents").hexdigest())
    repo = AptRepo(tmp_path / "state", Mirror("file:///nonexistent/debian"), "bookworm")
    assert repo.download(record, tmp_path) == deb
