"""Importing a container image tarball as a guest root tree.

Accepts ``docker save`` output (``manifest.json`` plus layer tars) and OCI image-layout tarballs
(``index.json``, ``blobs/sha256/...``). Layers are applied in order with overlayfs semantics:
``.wh.NAME`` deletes ``NAME`` from the layers below and ``.wh..wh..opq`` empties its directory of
them. Entries are never written through a symlink, and names or hard links that would leave the
tree are refused, since the tarball may come from anywhere.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forkd.image.apt import ARCH
from forkd.image.errors import SourceError, UnsafeArchive
from forkd.image.tree import remove_entry, resolve_in_root

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_OS = "linux"
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


def import_oci(tarball: Path, root: Path, progress: Callable[[str], None] = lambda s: None) -> None:
    """Unpack the single image in ``tarball`` into the empty directory ``root``."""
    try:
        with tarfile.open(tarball) as outer:
            members = {_safe_name(m.name): m for m in outer.getmembers() if not m.isdir()}
            layers = _layer_paths(outer, members)
            for number, name in enumerate(layers, start=1):
                progress(f"applying layer {number}/{len(layers)}")
                with tarfile.open(fileobj=_open(outer, members, name), mode="r|*") as layer:
                    apply_layer(layer, root)
    except (tarfile.TarError, json.JSONDecodeError, KeyError) as exc:
        raise SourceError(f"{tarball} is not a readable image tarball ({exc}): "
                          f"create it with `docker save IMAGE -o FILE` or as an OCI layout tar") from exc


def _layer_paths(outer: tarfile.TarFile, members: dict[str, tarfile.TarInfo]) -> list[str]:
    """Names of the layer blobs inside ``outer``, lowest first."""
    if "manifest.json" in members:
        images = _read_json(outer, members, "manifest.json")
        if len(images) != 1:
            raise SourceError(f"the tarball holds {len(images)} images: save exactly one image")
        return [_safe_name(layer) for layer in images[0]["Layers"]]
    if "index.json" in members:
        manifest = _oci_manifest(outer, members, _read_json(outer, members, "index.json"))
        return [_blob_path(layer["digest"]) for layer in manifest["layers"]]
    raise SourceError("the tarball has neither manifest.json (docker save) nor index.json (OCI layout)")


def _oci_manifest(outer: tarfile.TarFile, members: dict[str, tarfile.TarInfo], index: dict[str, Any]) -> Any:
    """Follow an OCI index (possibly nested, possibly multi-platform) to the linux/amd64 image manifest."""
    descriptors = index["manifests"]
    if len(descriptors) > 1:
        descriptors = [d for d in descriptors
                       if d.get("platform", {}).get("architecture") == ARCH and d["platform"].get("os") == _OS]
    if len(descriptors) != 1:
        raise SourceError(f"the OCI index offers {len(descriptors)} {_OS}/{ARCH} images: export exactly one")
    document = _read_json(outer, members, _blob_path(descriptors[0]["digest"]))
    if descriptors[0].get("mediaType") in _INDEX_TYPES or "manifests" in document:
        return _oci_manifest(outer, members, document)
    return document


def _blob_path(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise UnsafeArchive(f"unsupported or malformed blob digest {digest!r}: only sha256 is supported")
    return f"blobs/sha256/{hexdigest}"


def _read_json(outer: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: str) -> Any:
    return json.load(_open(outer, members, name))


def _open(outer: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: str) -> Any:
    if name not in members:
        raise SourceError(f"the tarball lacks {name}, which its manifest refers to: export the image again")
    return outer.extractfile(members[name])


def apply_layer(layer: tarfile.TarFile, root: Path) -> None:
    """Apply one layer on top of the tree at ``root``.

    Whiteouts refer to the layers below, wherever they appear in this one, so paths this layer has
    already written are kept.
    """
    written: set[str] = set()
    for member in layer:
        name = _safe_name(member.name)
        if not name:
            continue
        parent, base = posixpath.split(name)
        try:
            if base == OPAQUE:
                _clear_below(root, parent, written)
            elif base.startswith(WHITEOUT):
                hidden = posixpath.join(parent, base.removeprefix(WHITEOUT))
                if hidden not in written:
                    remove_entry(resolve_in_root(root, parent) / posixpath.basename(hidden))
            else:
                _extract(layer, member, name, root)
                written.update(_with_parents(name))
        except OSError as exc:
            raise SourceError(f"cannot apply layer entry {name}: {exc}") from exc


def _extract(layer: tarfile.TarFile, member: tarfile.TarInfo, name: str, root: Path) -> None:
    """Write ``member`` at ``name``, replacing whatever non-directory (or any symlink) is there."""
    parent_dir = resolve_in_root(root, posixpath.dirname(name))
    parent_dir.mkdir(parents=True, exist_ok=True)
    target = parent_dir / posixpath.basename(name)
    if not (member.isdir() and target.is_dir() and not target.is_symlink()):
        remove_entry(target)
    linkname = member.linkname
    if member.islnk():
        linkname = _hardlink_target(root, member)
    elif member.issym():
        _check_symlink(name, linkname)
    safe = member.replace(name=str(target.relative_to(root)), linkname=linkname, deep=False)
    layer.extract(safe, root, numeric_owner=True, filter="fully_trusted")


def _hardlink_target(root: Path, member: tarfile.TarInfo) -> str:
    """The hard link's target relative to ``root``; it must be an existing non-directory inside the tree."""
    link = _safe_name(member.linkname)
    target = resolve_in_root(root, posixpath.dirname(link)) / posixpath.basename(link)
    if not link or not (target.is_symlink() or target.exists()) or target.is_dir():
        raise UnsafeArchive(f"hard link {member.name} -> {member.linkname} does not name a file in the image")
    return str(target.relative_to(root))


def _check_symlink(name: str, target: str) -> None:
    """Refuse relative symlinks whose ``..`` climb above the tree; absolute ones are the guest's own paths."""
    if target.startswith("/"):
        return
    if posixpath.normpath(posixpath.join(posixpath.dirname(name), target)).split("/")[0] == "..":
        raise UnsafeArchive(f"symlink {name} -> {target} points outside the image")


def _clear_below(root: Path, directory: str, keep: set[str]) -> None:
    """Empty ``directory`` of everything not in ``keep`` (paths this layer wrote, and their parents)."""
    host_dir = resolve_in_root(root, directory)
    if not host_dir.is_dir():
        return
    for child in host_dir.iterdir():
        rel = posixpath.join(directory, child.name)
        if rel not in keep:
            remove_entry(child)
        elif child.is_dir() and not child.is_symlink():
            _clear_below(root, rel, keep)


def _with_parents(name: str) -> list[str]:
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _safe_name(name: str) -> str:
    """``name`` as a clean relative path (``""`` for the root itself); absolute or ``..`` names are refused."""
    if name.startswith("/"):
        raise UnsafeArchive(f"archive entry {name!r} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"archive entry {name!r} climbs out of the tree with '..'")
    return "/".join(parts)
