"""Extra CA certificates baked into an image, for hosts whose outbound TLS goes through a proxy that
re-signs traffic with its own CA: without that CA a guest's HTTPS fails with CERTIFICATE_VERIFY_FAILED
although the host (which trusts it) works.

The certificates travel as PEM text in the image spec (so the image key covers their content); the
builder writes them under ``/usr/local/share/ca-certificates/forkd/`` in the root tree and runs the
tree's own ``update-ca-certificates`` in a chroot, which adds them to the system bundle and the
hashed directory every TLS library in the guest reads.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

from forkd.image.commands import run
from forkd.image.errors import SourceError
from forkd.image.tree import resolve_in_root, write_in_root
from forkd.validation import ValidationError

GUEST_CA_DIR = "/usr/local/share/ca-certificates/forkd"
CA_PACKAGE = "ca-certificates"
MAX_CERTS = 50
MAX_CERT_BYTES = 64 * 1024
_PEM_RE = re.compile(r"-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+-----END CERTIFICATE-----\r?\n?")


def check_ca_certs(certs: Sequence[str]) -> None:
    """Refuse anything but a bounded list of PEM certificates (they are written into the guest's trust store)."""
    if len(certs) > MAX_CERTS:
        raise ValidationError(f"at most {MAX_CERTS} CA certificates per image, got {len(certs)}")
    for index, pem in enumerate(certs):
        if not isinstance(pem, str) or len(pem.encode()) > MAX_CERT_BYTES:
            raise ValidationError(f"CA certificate {index} must be PEM text of at most {MAX_CERT_BYTES} bytes")
        if not _PEM_RE.fullmatch(pem.strip() + "\n"):
            raise ValidationError(f"CA certificate {index} is not one PEM 'BEGIN CERTIFICATE' block")


def ca_cert_digests(certs: Sequence[str]) -> list[str]:
    """SHA-256 of each certificate's text: what the image key and manifest record instead of the PEM."""
    return [hashlib.sha256(pem.strip().encode()).hexdigest() for pem in certs]


def install_ca_certs(root: Path, certs: Sequence[str]) -> None:
    """Add ``certs`` to the trust store of the root tree at ``root`` (needs its ``update-ca-certificates``)."""
    if not certs:
        return
    updater = resolve_in_root(root, "/usr/sbin/update-ca-certificates")
    if not updater.exists():
        raise SourceError(f"the root tree has no update-ca-certificates: install the {CA_PACKAGE} package in it "
                          "to add CA certificates")
    for digest, pem in zip(ca_cert_digests(certs), certs, strict=True):
        write_in_root(root, f"{GUEST_CA_DIR}/{digest[:16]}.crt", (pem.strip() + "\n").encode())
    run(["chroot", root, "/usr/sbin/update-ca-certificates"],
        hint="update-ca-certificates failed in the image's root tree: check the certificates are valid PEM")
