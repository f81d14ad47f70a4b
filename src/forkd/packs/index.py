"""Pack indexes ("hubs"): a JSON document listing packs by name, with where to get each and its digest.

An index is a file or a URL. Each entry says which tag the pack unpacks as, its URL (absolute,
or relative to the index's own location, so an index can sit next to its packs), its size and
SHA-256 (checked after the download, before unpacking) and the machine identity it restores on
(checked before downloading anything).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urljoin

import httpx
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from forkd.packs.archive import read_manifest
from forkd.packs.format import MAX_FILE_BYTES, PackError, Sha256, Tag, check_identity_fields, parse_versioned
from forkd.packs.transfer import UrlPolicy, fetch, local_path, read_limited, shown
from forkd.store.files import sha256_file, write_json_atomic

INDEX_FORMAT = "forkd-index"
INDEX_VERSION = 1
MAX_INDEX_BYTES = 8 << 20


class IndexEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Tag
    tag: Tag
    url: Annotated[str, Field(min_length=1, max_length=8192)]
    sha256: Sha256
    size: StrictInt = Field(ge=1, le=MAX_FILE_BYTES)
    identity: dict[str, Any]
    description: str = Field(default="", max_length=2000)

    @model_validator(mode="after")
    def _identity(self) -> IndexEntry:
        check_identity_fields(self.identity)
        return self


class Index(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["forkd-index"] = INDEX_FORMAT
    format_version: Literal[1] = INDEX_VERSION
    updated_at: float = 0.0
    packs: list[IndexEntry] = Field(default_factory=list, max_length=10000)

    def find(self, name: str) -> IndexEntry:
        for entry in self.packs:
            if entry.name == name:
                return entry
        names = ", ".join(e.name for e in self.packs) or "none"
        raise LookupError(f"the index lists no pack named {name!r} (it lists: {names})")


def parse_index(raw: bytes, where: str) -> Index:
    return parse_versioned(raw, Index, INDEX_FORMAT, INDEX_VERSION, f"index {where}")


async def load_index(location: str, policy: UrlPolicy = UrlPolicy()) -> tuple[Index, str]:
    """The index at ``location`` (path, file:// or http(s):// URL) and the base its relative URLs resolve against."""
    path = local_path(location)
    if path is not None:
        try:
            if path.stat().st_size > MAX_INDEX_BYTES:
                raise PackError(f"index {path} is larger than {MAX_INDEX_BYTES} bytes")
            raw = path.read_bytes()
        except OSError as exc:
            raise PackError(f"cannot read index {path}: {exc.strerror}") from None
        return parse_index(raw, str(path)), path.resolve().as_uri()
    try:
        async with fetch(location, policy) as response:
            if response.status_code != 200:
                raise PackError(f"cannot fetch index {shown(location)}: HTTP {response.status_code}")
            raw = await read_limited(response, MAX_INDEX_BYTES, f"index {shown(location)}")
            base = str(response.url)
    except httpx.HTTPError as exc:
        raise PackError(f"cannot fetch index {shown(location)}: {exc}") from None
    return parse_index(raw, shown(location)), base


def entry_url(entry: IndexEntry, base: str) -> str:
    return urljoin(base, entry.url)


def add_to_index(index_path: Path, pack: Path, name: str, url: str, description: str = "") -> IndexEntry:
    """Add (or replace) the entry ``name`` for ``pack`` in the index file, creating it if needed."""
    manifest = read_manifest(pack)
    entry = IndexEntry(name=name, tag=manifest.top.tag, url=url, sha256=sha256_file(pack),
                       size=pack.stat().st_size, identity=manifest.identity, description=description)
    index = parse_index(index_path.read_bytes(), str(index_path)) if index_path.exists() else Index()
    packs = [e for e in index.packs if e.name != name] + [entry]
    write_json_atomic(index_path, Index(packs=packs, updated_at=time.time()).model_dump(mode="json"))
    return entry
