"""Which host files an API client may name: only those under the daemon's configured roots.

A client names host paths when it builds an image from a tree or an OCI tarball, writes or unpacks
a pack, or pulls from a file. Unbounded, that makes every token a key to the host's whole
filesystem (``source_dir="/"`` copies the host into a guest; a pack written with ``force`` over any
file). So the daemon reads imports only from ``imports_dir`` and reads and writes packs only in
``packs_dir``; anything else is refused, saying where to put the file. Paths are resolved first,
so a symlink or ``..`` cannot lead out of a root.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forkd.validation import ValidationError


class OutsideRoots(ValidationError):
    """A host path an API client named lies outside the directories the daemon may use for it."""


@dataclass(frozen=True)
class HostRoots:
    imports: Path  # image sources: root trees (--from-dir) and OCI tarballs (--from-oci)
    packs: Path  # packs written, unpacked and pulled from files

    @classmethod
    def under(cls, home: Path) -> HostRoots:
        return cls(imports=home / "imports", packs=home / "packs")

    def create(self) -> None:
        """Make the roots (0700: only root may drop files the daemon will read)."""
        for root in (self.imports, self.packs):
            root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def import_source(self, path: Path, what: str) -> Path:
        return _confine(path, self.imports, what, "imports_dir", output=False)

    def pack_input(self, path: Path, what: str = "pack") -> Path:
        return _confine(path, self.packs, what, "packs_dir", output=False)

    def pack_output(self, path: Path) -> Path:
        return _confine(path, self.packs, "pack output", "packs_dir", output=True)


def _confine(path: Path, root: Path, what: str, key: str, output: bool) -> Path:
    """``path`` resolved, if it lies under ``root``; else :class:`OutsideRoots` saying where to put it."""
    if not path.is_absolute():
        raise ValidationError(f"{what} {path} must be an absolute path on the daemon's host")
    try:
        base = root.resolve(strict=True)
        # An output need not exist yet, but the directory it goes in must, and must be inside the root.
        resolved = path.parent.resolve(strict=True) / path.name if output else path.resolve(strict=True)
    except FileNotFoundError:
        raise ValidationError(f"{what} {path} does not exist on the daemon's host"
                              f" (the daemon uses only files under {root})") from None
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte
        raise ValidationError(f"cannot use {what} {path}: {exc}") from None
    if resolved != base and base in resolved.parents:
        return resolved
    raise OutsideRoots(f"{what} {path} is outside {root}, the only directory the daemon uses for it: "
                       f"put the file under {root} and give that path (or set `{key}` in the daemon's config)")
