"""The pack format: what a ``.tar.zst`` snapshot pack holds and the manifest that describes it.

A pack is one zstd frame holding a POSIX (pax) tar stream. Its first member is ``manifest.json``;
then, for every snapshot of the chain in order (root first), that snapshot's ``meta.json`` and
then its files, each as ``<tag>/<name>``. Nothing else is allowed in it: every member is named by
the manifest, in the manifest's order, with the manifest's size and SHA-256. A member may be a
hard link to an earlier member with the same declared content (identical files of two layers are
stored once). The manifest is checked before any member is extracted, so a pack for another
machine or with a taken tag is refused before gigabytes are written.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from forkd.store.chains import layer_digest
from forkd.validation import TAG_PATTERN
from forkd.vmm.base import Q35, MachineIdentity, machine_of

FORMAT = "forkd-pack"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
META_NAME = "meta.json"
MAX_MANIFEST_BYTES = 1 << 20
MAX_CHAIN_DEPTH = 32
MAX_FILES_PER_SNAPSHOT = 64
MAX_FILE_BYTES = 1 << 40  # 1 TiB: larger than any guest RAM or disk forkd makes
FILE_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$"

Tag = Annotated[str, Field(pattern=TAG_PATTERN)]
M = TypeVar("M", bound=BaseModel)
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
FileName = Annotated[str, Field(pattern=FILE_NAME_PATTERN)]


class PackError(ValueError):
    """A pack, index or download was refused; the message says which member or field and why."""

    kind = "pack_refused"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PackFile(_Strict):
    name: FileName
    size: StrictInt = Field(ge=0, le=MAX_FILE_BYTES)
    sha256: Sha256


class PackSnapshot(_Strict):
    """One snapshot directory of the chain."""

    tag: Tag
    parent_tag: Tag | None = None
    digest: Sha256 = Field(description="layer_digest() of the snapshot's files")
    parent_digest: Sha256 | None = None
    image: str = Field(max_length=200)
    created_at: float
    files: list[PackFile] = Field(min_length=2, max_length=MAX_FILES_PER_SNAPSHOT)

    @model_validator(mode="after")
    def _consistent(self) -> PackSnapshot:
        names = [f.name for f in self.files]
        if names[0] != META_NAME:
            raise ValueError(f"the first file of snapshot {self.tag!r} must be {META_NAME}")
        if len(set(names)) != len(names):
            raise ValueError(f"snapshot {self.tag!r} lists a file twice")
        if (self.parent_tag is None) != (self.parent_digest is None):
            raise ValueError(f"snapshot {self.tag!r}: parent_tag and parent_digest go together")
        if self.digest != layer_digest({f.name: f.sha256 for f in self.content_files}):
            raise ValueError(f"snapshot {self.tag!r}: digest does not match its files")
        return self

    @property
    def content_files(self) -> list[PackFile]:
        """The files a snapshot's ``meta.json`` records digests for (all but meta.json itself)."""
        return self.files[1:]


class Manifest(_Strict):
    format: Literal["forkd-pack"]
    format_version: Literal[1]
    forkd_version: str = Field(max_length=100)
    created_at: float
    identity: dict[str, Any] = Field(description="MachineIdentity of the top snapshot")
    snapshots: list[PackSnapshot] = Field(min_length=1, max_length=MAX_CHAIN_DEPTH)

    @model_validator(mode="after")
    def _chain(self) -> Manifest:
        tags = [s.tag for s in self.snapshots]
        if len(set(tags)) != len(tags):
            raise ValueError("a tag appears twice in the chain")
        for parent, child in zip(self.snapshots, self.snapshots[1:]):
            if child.parent_tag != parent.tag or child.parent_digest != parent.digest:
                raise ValueError(f"snapshot {child.tag!r} does not name the snapshot before it ({parent.tag!r}) "
                                 "as its parent with that parent's digest: the chain is inconsistent")
        check_identity_fields(self.identity)
        return self

    @property
    def top(self) -> PackSnapshot:
        return self.snapshots[-1]

    def machine_identity(self) -> MachineIdentity:
        return MachineIdentity.from_dict(self.identity)

    def total_bytes(self) -> int:
        return sum(f.size for s in self.snapshots for f in s.files)


def check_identity_fields(identity: dict[str, Any]) -> None:
    """Raise ``ValueError`` (for pydantic) unless ``identity`` has every MachineIdentity field."""
    try:
        MachineIdentity.from_dict(identity)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"identity is incomplete ({exc})") from None


def parse_versioned(raw: bytes, model: type[M], kind: str, version: int, where: str) -> M:
    """A JSON document of ``kind`` (``forkd-pack``, ``forkd-index``) in ``version``, or a :class:`PackError`."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PackError(f"{where} is not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != kind:
        raise PackError(f"{where} is not a {kind} document: it has no \"format\": \"{kind}\"")
    if data.get("format_version") != version:
        raise PackError(f"{kind} format version {data.get('format_version')!r} is not supported: this forkd reads "
                        f"version {version}; use the forkd that wrote it, or write it again with this one")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'document'}: {e['msg']}" for e in exc.errors())
        raise PackError(f"invalid {where}: {problems}") from None


def parse_manifest(raw: bytes) -> Manifest:
    return parse_versioned(raw, Manifest, FORMAT, FORMAT_VERSION, MANIFEST_NAME)


def check_meta(entry: PackSnapshot, raw: bytes, identity: MachineIdentity) -> dict[str, Any]:
    """A snapshot's ``meta.json`` from a pack, checked against its manifest entry; returns it parsed."""
    where = member_name(entry.tag, META_NAME)
    try:
        meta = json.loads(raw)
        saved_identity = MachineIdentity.from_dict(meta["identity"])
        recorded, boot = meta["sha256"], meta["boot"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise PackError(f"{where} is not a snapshot's metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(boot, dict) or not all(isinstance(boot.get(k), int) for k in ("memory_mib", "vcpus")):
        raise PackError(f"{where} has no boot memory_mib and vcpus")
    if boot["memory_mib"] != saved_identity.memory_mib:  # the RAM a restore maps is the size packs are checked against
        raise PackError(f"{where} boots {boot['memory_mib']} MiB of RAM but records {saved_identity.memory_mib} MiB "
                        "in its identity: the pack is inconsistent")
    if boot.get("machine", Q35) != machine_of(saved_identity.machine):  # children start as boot says, load as identity
        raise PackError(f"{where} boots machine {boot.get('machine', Q35)!r} but records {saved_identity.machine!r} in "
                        "its identity: the pack is inconsistent")
    if recorded != {f.name: f.sha256 for f in entry.content_files}:
        raise PackError(f"{where} records other files or digests than the manifest lists")
    differences = saved_identity.differences(identity)
    if differences:  # every layer of a chain restores on the machine the top one does
        raise PackError(f"{where} was saved on another machine than the manifest says: " + "; ".join(differences))
    return meta


def member_name(tag: str, name: str) -> str:
    return f"{tag}/{name}"


_SAFE_MEMBER = re.compile(r"^[A-Za-z0-9_-]{1,64}/[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")


def check_member_path(name: str) -> None:
    """Refuse a member path that could land outside the extraction directory, with the reason."""
    if name.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", name):
        raise PackError(f"member {name!r} has an absolute path; packs hold only <tag>/<file> paths")
    if ".." in re.split(r"[\\/]", name):
        raise PackError(f"member {name!r} climbs out of the pack with '..'")
    if name != MANIFEST_NAME and not _SAFE_MEMBER.fullmatch(name):
        raise PackError(f"member {name!r} is not a <tag>/<file> path with a safe tag and file name")
