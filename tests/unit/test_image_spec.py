"""The image spec: validation at the boundary, and a cache key that changes exactly when the image would."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

import forkd.guest.protocol
from forkd.image.agent import AgentPayload, current_agent
from forkd.image.certs import install_ca_certs
from forkd.image.errors import SourceError
from forkd.image.rootfs import debootstrap_cache_path
from forkd.image.spec import ImageSpec
from forkd.validation import ValidationError

AGENT = AgentPayload(files=(("__init__.py", b""), ("agent.py", b"AGENT_VERSION = '1'\n")), version="1")


CERT = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n"


def key(**changes: object) -> str:
    return ImageSpec(**changes).key(AGENT)  # type: ignore[arg-type]


def test_key_is_stable_and_ignores_name_mirror_and_package_order() -> None:
    base = key()
    assert key() == base
    assert key(name="other") == base
    assert key(mirror="http://mirror.example.test/debian") == base
    assert key(packages=("python3-pytest", "python3-numpy", "python3", "python3")) == base


@pytest.mark.parametrize("changes", [
    {"suite": "trixie"},
    {"packages": ("python3", "python3-numpy", "git")},
    {"kernel_package": "linux-image-amd64"},
    {"kernel_suite": "bookworm"},
    {"disk_size_mib": 2048},
])
def test_key_changes_with_any_input(changes: dict[str, object]) -> None:
    assert key(**changes) != key()


def test_key_changes_with_the_agent_sources() -> None:
    edited = dataclasses.replace(AGENT, files=(*AGENT.files, ("init.py", b"print('hi')\n")))
    assert ImageSpec().key(edited) != ImageSpec().key(AGENT)


def test_key_follows_the_content_of_an_oci_tarball(tmp_path: Path) -> None:
    tarball = tmp_path / "image.tar"
    tarball.write_bytes(b"one")
    first = key(source_oci=tarball)
    assert first != key()
    tarball.write_bytes(b"two")
    assert key(source_oci=tarball) != first


def test_key_follows_edits_to_a_source_directory(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "os-release").write_text("ID=test\n")
    first = key(source_dir=tmp_path)
    assert key(source_dir=tmp_path) == first
    (tmp_path / "etc" / "os-release").write_text("ID=test2\n")
    assert key(source_dir=tmp_path) != first


def test_missing_sources_are_reported(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        key(source_oci=tmp_path / "missing.tar")
    with pytest.raises(SourceError, match="does not exist"):
        key(source_dir=tmp_path / "missing")


@pytest.mark.parametrize("changes", [
    {"name": "../etc"},
    {"packages": ("python3", "vim,curl")},
    {"packages": ("python3 --foo",)},
    {"kernel_package": "-linux"},
    {"suite": "bookworm; rm -rf /"},
    {"mirror": "ftp://mirror.example.test/debian"},
    {"disk_size_mib": 10},
    {"source_dir": Path("/a"), "source_oci": Path("/b.tar")},
    {"ca_certs": ("not a certificate",)},
    {"ca_certs": (CERT + CERT,)},
    {"ca_certs": (CERT + "; rm -rf /\n",)},
    {"ca_certs": (CERT,) * 51},
])
def test_invalid_specs_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ImageSpec(**changes)  # type: ignore[arg-type]


def test_to_dict_is_json_ready(tmp_path: Path) -> None:
    spec = ImageSpec(name="custom", source_oci=tmp_path / "x.tar", packages=("python3",))
    assert spec.to_dict() == {
        "name": "custom", "suite": "bookworm", "packages": ["python3"], "mirror": None,
        "kernel_package": "linux-image-cloud-amd64", "kernel_suite": "bookworm-backports",
        "source_dir": None, "source_oci": str(tmp_path / "x.tar"), "disk_size_mib": None, "ca_certs_sha256": [],
    }


def test_debootstrap_cache_is_keyed_by_suite_and_package_set(tmp_path: Path) -> None:
    path = debootstrap_cache_path(tmp_path, "bookworm", ["python3", "python3-numpy"])
    assert path == debootstrap_cache_path(tmp_path, "bookworm", ["python3-numpy", "python3", "python3"])
    assert path != debootstrap_cache_path(tmp_path, "bookworm", ["python3"])
    assert path != debootstrap_cache_path(tmp_path, "trixie", ["python3", "python3-numpy"])
    assert path.parent == tmp_path and path.name.startswith("debootstrap-bookworm-")


def test_current_agent_is_the_guest_package() -> None:
    agent = current_agent()
    names = [name for name, _ in agent.files]
    assert {"__init__.py", "agent.py", "protocol.py"} <= set(names)
    assert names == sorted(names)
    assert agent.version == forkd.guest.protocol.AGENT_VERSION


def test_ca_certificates_change_the_key_and_add_their_package() -> None:
    with_cert = ImageSpec(ca_certs=(CERT,))
    assert with_cert.key(AGENT) != key()
    assert with_cert.key(AGENT) != ImageSpec(ca_certs=(CERT.replace("MIIB", "MIIC"),)).key(AGENT)
    assert "ca-certificates" in with_cert.root_packages
    assert "ca-certificates" not in ImageSpec().root_packages
    assert with_cert.to_dict()["ca_certs_sha256"] == [hashlib.sha256(CERT.strip().encode()).hexdigest()]


def test_ca_certificates_need_the_trees_updater(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="install the ca-certificates package"):
        install_ca_certs(tmp_path, [CERT])
    install_ca_certs(tmp_path, [])  # nothing asked, nothing needed
