"""What an image is built from, and the cache key that says whether a built image is still current."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.image.agent import AgentPayload, current_agent
from forkd.image.apt import MIRROR_SCHEMES
from forkd.image.certs import CA_PACKAGE, ca_cert_digests, check_ca_certs
from forkd.image.errors import SourceError
from forkd.image.rootfs import DEBOOTSTRAP_FORMAT
from forkd.image.tree import tree_fingerprint
from forkd.store.files import sha256_file
from forkd.validation import ValidationError, check_range, check_tag

#: Bump when the builder's output for the same inputs changes (init script, layout, mkfs options...).
BUILD_FORMAT = 2  # 2: the initramfs loads virtio_mmio (microvm snapshots)
MIN_DISK_MIB, MAX_DISK_MIB = 256, 1024 * 1024
_PACKAGE_RE = re.compile(r"[a-z0-9][a-z0-9+.-]+")  # Debian policy 5.6.1
_SUITE_RE = re.compile(r"[a-z0-9][a-z0-9.-]*")


# Every image: Python, numpy for the warm-runtime demo, pytest for test fan-out (evaluation harnesses).
BASE_PACKAGES = ("python3", "python3-numpy", "python3-pytest")


@dataclass(frozen=True)
class ImageSpec:
    """The inputs of an image build. Fields are checked on creation, since they reach commands and paths."""

    name: str = "default"
    suite: str = "bookworm"
    packages: tuple[str, ...] = BASE_PACKAGES
    mirror: str | None = None
    kernel_package: str = "linux-image-cloud-amd64"
    kernel_suite: str = "bookworm-backports"
    source_dir: Path | None = None
    source_oci: Path | None = None
    disk_size_mib: int | None = None
    ca_certs: tuple[str, ...] = ()  # PEM texts added to the guest's trust store (see image/certs.py)

    def __post_init__(self) -> None:
        check_tag(self.name, "image name")
        for package in (*self.packages, self.kernel_package):
            _check_pattern(package, _PACKAGE_RE, "Debian package name")
        for suite in (self.suite, self.kernel_suite):
            _check_pattern(suite, _SUITE_RE, "Debian suite")
        if self.mirror is not None and not self.mirror.startswith(MIRROR_SCHEMES):
            raise ValidationError(f"mirror {self.mirror!r} must be an http://, https:// or file:/ URL")
        if self.source_dir is not None and self.source_oci is not None:
            raise ValidationError("pass either a source directory or an OCI tarball, not both")
        if self.disk_size_mib is not None:
            check_range(self.disk_size_mib, "disk size (MiB)", MIN_DISK_MIB, MAX_DISK_MIB)
        check_ca_certs(self.ca_certs)

    @property
    def root_packages(self) -> tuple[str, ...]:
        """What debootstrap installs: the packages asked for, plus what installing CA certificates needs."""
        return tuple(dict.fromkeys((*self.packages, *((CA_PACKAGE,) if self.ca_certs else ()))))

    def key(self, agent: AgentPayload | None = None) -> str:
        """SHA-256 naming everything the image is made of, except its name and the mirror host.

        Any Debian mirror serves the same archive; the kernel version actually fetched is recorded in
        the manifest. ``agent`` defaults to the agent of this forkd installation.
        """
        agent = agent or current_agent()
        identity = {
            "format": BUILD_FORMAT,
            "suite": self.suite,
            "kernel": [self.kernel_package, self.kernel_suite],
            "root": self._root_identity(),
            "disk_size_mib": self.disk_size_mib,
            "agent": agent.digest(),
        }
        if self.ca_certs:  # only then, so images without extra certificates keep their keys
            identity["ca_certs"] = ca_cert_digests(self.ca_certs)
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def _root_identity(self) -> dict[str, Any]:
        if self.source_dir is not None:
            if not self.source_dir.is_dir():
                raise SourceError(f"source directory {self.source_dir} does not exist")
            return {"dir": tree_fingerprint(self.source_dir)}
        if self.source_oci is not None:
            if not self.source_oci.is_file():
                raise SourceError(f"OCI tarball {self.source_oci} does not exist")
            return {"oci": sha256_file(self.source_oci)}
        return {"debootstrap": sorted(set(self.root_packages)), "format": DEBOOTSTRAP_FORMAT}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, as recorded in the image manifest."""
        return {
            "name": self.name, "suite": self.suite, "packages": list(self.packages), "mirror": self.mirror,
            "kernel_package": self.kernel_package, "kernel_suite": self.kernel_suite,
            "source_dir": str(self.source_dir) if self.source_dir else None,
            "source_oci": str(self.source_oci) if self.source_oci else None,
            "disk_size_mib": self.disk_size_mib, "ca_certs_sha256": ca_cert_digests(self.ca_certs),
        }


def _check_pattern(value: object, pattern: re.Pattern[str], what: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValidationError(f"invalid {what} {value!r}")
