"""Errors of the image builder.

Every message ends with what the user can do next: these strings reach the CLI and the REST API
unchanged.
"""

from __future__ import annotations


class ImageError(Exception):
    """Building, finding or loading a guest image failed."""

    kind = "image_error"


class ImageNotFound(ImageError, LookupError):
    """No image of that name has been built."""

    kind = "not_found"


class ImageBusy(ImageError):
    """Another build or removal of the image holds its lock (in this daemon or another process)."""

    kind = "conflict"


class ImageDamaged(ImageError):
    """An image directory exists but its manifest or files are missing or unreadable."""


class MirrorNotFound(ImageError):
    """No Debian mirror is configured for the suite the image needs."""


class ToolError(ImageError):
    """A host tool (apt-get, debootstrap, mkfs.ext4, ...) is missing or failed."""


class KernelError(ImageError):
    """The kernel or busybox package lacks a file or module the guest needs to boot."""


class SourceError(ImageError):
    """A user-supplied root tree or OCI tarball cannot be turned into a guest root."""


class UnsafeArchive(SourceError):
    """An archive entry would land outside the tree it is unpacked into."""
