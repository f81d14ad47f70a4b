"""Writing and reading pack archives: streamed tar inside zstd, never a whole file in memory.

Reading is the security boundary: a pack may come from anywhere, so every member is checked
against the manifest (name, order, type, size, SHA-256) as it streams past, the decompressed
volume is capped at what the manifest declares, and runs of zeros are written as holes so a
mostly empty guest RAM file stays sparse on disk.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import zstandard

from forkd import __version__
from forkd.packs.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    META_NAME,
    Manifest,
    PackError,
    PackFile,
    PackSnapshot,
    check_member_path,
    check_meta,
    layer_digest,
    member_name,
    parse_manifest,
)
from forkd.packs.partials import partial_path
from forkd.packs.meter import Meter
from forkd.store.files import fsync_dir, link_or_copy
from forkd.vmm.disk import DiskFormat, UnsafeDisk

Progress = Callable[[str], None]

CHUNK = 1 << 20
HOLE_BLOCK = 64 * 1024  # all-zero aligned blocks of this size are left as holes
_ZEROS = bytes(HOLE_BLOCK)
ZSTD_LEVEL = 3
MAX_WINDOW_BYTES = 1 << 27  # bounds the decompressor's memory whatever the frame asks for
_MEMBER_OVERHEAD = 4096  # pax + ustar headers and padding of one member, generously
_MAX_TAR_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True)
class SourceSnapshot:
    """A registered snapshot as the packer reads it; files and digests come from its ``meta.json``,
    its parent from its registry record."""

    tag: str
    directory: Path
    image: str
    created_at: float
    parent_tag: str | None
    # The parent's layer digest when the parent is not in the pack (a chain sent without the layers
    # its receiver already holds); None for a chain's root.
    parent_digest: str | None = None


@dataclass(frozen=True)
class WrittenPack:
    path: Path
    size: int
    sha256: str
    manifest: Manifest


@dataclass
class Plan:
    """Where each snapshot of a pack goes, decided by the caller once it has seen the manifest.

    ``targets`` maps every pack tag to a directory: a new one to extract into, or, for a tag in
    ``reuse`` (the store already holds that snapshot with the same digest), the store's own, whose
    members are verified and discarded. ``store_files`` lists the files of ancestors only in the
    store, which the first layer's disk may back onto.
    """

    targets: dict[str, Path]
    reuse: set[str] = field(default_factory=set)
    store_files: dict[str, set[str]] = field(default_factory=dict)


# writing -------------------------------------------------------------------------------------------

class _HashingReader(io.RawIOBase):
    """Reads a file for tarfile while hashing it, so packing reads every byte once."""

    def __init__(self, f: IO[bytes], meter: Meter) -> None:
        self._f, self._meter = f, meter
        self.hash = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        self.hash.update(memoryview(buffer)[:n])
        self._meter.advance(n)
        return n


class _HashingWriter(io.RawIOBase):
    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._f.write(data)
        self.hash.update(data)
        self.size += len(data)
        return len(data)


def build_manifest(chain: list[SourceSnapshot]) -> Manifest:
    """The manifest of a chain (root first), from the digests recorded when each was saved."""
    entries: list[PackSnapshot] = []
    identity: dict[str, Any] = {}
    for snapshot in chain:
        meta_path = snapshot.directory / META_NAME
        raw = meta_path.read_bytes()
        meta = json.loads(raw)
        identity = meta["identity"]
        files = [PackFile(name=META_NAME, size=len(raw), sha256=hashlib.sha256(raw).hexdigest())]
        files += [PackFile(name=name, size=(snapshot.directory / name).stat().st_size, sha256=digest)
                  for name, digest in meta["sha256"].items()]
        parent = entries[-1] if entries else None
        entries.append(PackSnapshot(
            tag=snapshot.tag, parent_tag=snapshot.parent_tag,
            digest=layer_digest(meta["sha256"]), parent_digest=parent.digest if parent else snapshot.parent_digest,
            image=snapshot.image, created_at=snapshot.created_at, files=files))
    return Manifest(format="forkd-pack", format_version=1, forkd_version=__version__, created_at=time.time(),
                    identity=identity, snapshots=entries)


def check_output(output: Path, force: bool) -> None:
    """Refuse a pack output that is relative, in a missing directory, or (without ``force``) taken."""
    if not output.is_absolute():
        raise PackError(f"pack output {output} must be an absolute path on the daemon's host")
    if not output.parent.is_dir():
        raise PackError(f"directory {output.parent} does not exist")
    if output.is_dir() or (output.exists() and not force):
        raise PackError(f"{output} exists; pass --force to overwrite it")


def write_pack(output: Path, chain: list[SourceSnapshot], progress: Progress, force: bool = False) -> WrittenPack:
    """Write ``chain`` to ``output`` (through a hidden partial file renamed at the end)."""
    check_output(output, force)
    partial = partial_path(output)
    try:
        with open(partial, "wb") as out:
            hashed = _HashingWriter(out)
            manifest = write_stream(hashed, chain, progress)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, output)
        fsync_dir(output.parent)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return WrittenPack(path=output, size=hashed.size, sha256=hashed.hash.hexdigest(), manifest=manifest)


def write_stream(out: IO[bytes], chain: list[SourceSnapshot], progress: Progress) -> Manifest:
    """Write the pack of ``chain`` (root first) to the writable ``out``, which is not closed; returns its manifest."""
    manifest = build_manifest(chain)
    meter = Meter(progress, "packed", manifest.total_bytes())
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1, write_checksum=True)
    with compressor.stream_writer(out, closefd=False) as zout:
        with tarfile.open(fileobj=zout, mode="w|", format=tarfile.PAX_FORMAT, bufsize=CHUNK) as tar:
            raw_manifest = manifest.model_dump_json(indent=1).encode()
            tar.addfile(_info(MANIFEST_NAME, len(raw_manifest), 0o600), io.BytesIO(raw_manifest))
            _write_members(tar, chain, manifest, meter)
    progress(meter.line())
    return manifest


def _write_members(tar: tarfile.TarFile, chain: list[SourceSnapshot], manifest: Manifest, meter: Meter) -> None:
    stored: dict[tuple[str, int], str] = {}  # (sha256, size) -> member holding that content
    for snapshot, entry in zip(chain, manifest.snapshots):
        for item in entry.files:
            name = member_name(entry.tag, item.name)
            earlier = stored.get((item.sha256, item.size))
            if earlier is not None:
                link = _info(name, 0, 0o400)
                link.type, link.linkname = tarfile.LNKTYPE, earlier
                tar.addfile(link)
                meter.advance(item.size)
                continue
            with open(snapshot.directory / item.name, "rb") as f:
                reader = _HashingReader(f, meter)
                tar.addfile(_info(name, item.size, 0o400), reader)
            if reader.hash.hexdigest() != item.sha256:
                raise PackError(f"snapshot {entry.tag!r}: {item.name} no longer matches the SHA-256 recorded when it "
                                f"was saved; it is corrupt: remove it with `forkd rmi {entry.tag}`")
            stored[(item.sha256, item.size)] = name


def _info(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, int(time.time())
    return info


# reading -------------------------------------------------------------------------------------------

class _StrictTarInfo(tarfile.TarInfo):
    """Refuses oversized extended headers before tarfile reads them into memory, and sparse members."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:  # tarfile's per-header hook
        if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) \
                and self.size > _MAX_TAR_HEADER_BYTES:
            raise PackError(f"a tar extended header of {self.size} bytes is larger than any pack needs")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise PackError(f"member {self.name!r} is a GNU sparse member; packs hold plain files")
        return super()._proc_member(tarfile_)


class _Budget(io.RawIOBase):
    """The decompressed stream, refused once it holds more than the manifest declares (zstd bombs)."""

    def __init__(self, raw: IO[bytes], limit: int) -> None:
        self._raw, self.limit, self.used = raw, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._raw.readinto(buffer)
        self.used += n
        if self.used > self.limit:
            raise PackError("the pack holds more data than its manifest declares")
        return n


class _PackReader:
    """One pass over a pack: the manifest first, then each member in the manifest's order."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self._file = open(source, "rb")
        try:
            self._zstd = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).stream_reader(
                self._file, read_size=CHUNK, closefd=False)
            # Until the manifest is read: the manifest plus what the readers buffer ahead of it.
            self.budget = _Budget(self._zstd, MAX_MANIFEST_BYTES + 3 * CHUNK)
            self.tar = _guard(lambda: tarfile.open(fileobj=io.BufferedReader(self.budget, CHUNK), mode="r|",
                                                   tarinfo=_StrictTarInfo, bufsize=CHUNK))
        except BaseException:
            self._file.close()
            raise

    def close(self) -> None:
        self._file.close()

    def next(self) -> tarfile.TarInfo | None:
        return _guard(self.tar.next)

    def manifest(self) -> Manifest:
        first = self.next()
        if first is None or first.name != MANIFEST_NAME or not first.isreg():
            raise PackError(f"{self.source} is not a forkd pack: its first member is not {MANIFEST_NAME}")
        if first.size > MAX_MANIFEST_BYTES:
            raise PackError(f"{MANIFEST_NAME} of {first.size} bytes is larger than any pack needs")
        manifest = parse_manifest(self.read_all(first))
        self.budget.limit = self.budget.used + manifest.total_bytes() + _MEMBER_OVERHEAD * (
            2 + sum(len(s.files) for s in manifest.snapshots))
        return manifest

    def read_all(self, member: tarfile.TarInfo) -> bytes:
        data = _guard(lambda: self.tar.extractfile(member).read())  # type: ignore[union-attr]
        if len(data) != member.size:
            raise PackError(f"the pack is truncated inside {member.name}")
        return data

    def stream(self, member: tarfile.TarInfo) -> Iterable[bytes]:
        source = self.tar.extractfile(member)
        assert source is not None
        remaining = member.size
        while remaining:
            chunk = _guard(lambda: source.read(min(CHUNK, remaining)))
            if not chunk:
                raise PackError(f"the pack is truncated inside {member.name}")
            remaining -= len(chunk)
            yield chunk


def _guard(action: Callable[[], Any]) -> Any:
    """Run one read of the pack, turning tar and zstd failures into a :class:`PackError`."""
    try:
        return action()
    except (tarfile.TarError, EOFError) as exc:
        raise PackError(f"the pack is truncated or is not a tar archive ({exc})") from None
    except zstandard.ZstdError as exc:
        raise PackError(f"the pack is not zstd-compressed or is damaged ({exc})") from None


def read_manifest(source: Path) -> Manifest:
    """Only the manifest of a pack (its first member), to decide where it goes before extracting."""
    reader = _PackReader(source)
    try:
        return reader.manifest()
    finally:
        reader.close()


def extract_pack(source: Path, plan_for: Callable[[Manifest], Plan], progress: Progress,
                 disk: DiskFormat) -> tuple[Manifest, dict[str, dict[str, Any]]]:
    """Verify every member of ``source`` and write the snapshots ``plan_for`` places; ``disk``, the
    VMM backend's disk format, checks each snapshot's files refer to nothing outside its chain.

    Returns the manifest and the parsed ``meta.json`` of each extracted snapshot, keyed by pack
    tag. Raises :class:`PackError` on the first problem; the caller removes what was written.
    """
    reader = _PackReader(source)
    try:
        manifest = reader.manifest()
        plan = plan_for(manifest)
        identity = manifest.machine_identity()
        meter = Meter(progress, "verified", manifest.total_bytes())
        written: dict[str, tuple[str, int, Path]] = {}  # member -> (sha256, size, file holding it)
        metas: dict[str, dict[str, Any]] = {}
        known_files = {tag: set(files) for tag, files in plan.store_files.items()}
        for entry in manifest.snapshots:
            directory = plan.targets[entry.tag]
            extracting = entry.tag not in plan.reuse
            if extracting:
                directory.mkdir()
            for item in entry.files:
                name = member_name(entry.tag, item.name)
                member = reader.next()
                if member is None:
                    raise PackError(f"the pack ends before {name}: it is truncated")
                _check_member(member, name, item, written)
                target = directory / item.name if extracting else None
                if member.islnk():
                    if target is not None:
                        link_or_copy(written[member.linkname][2], target)
                    meter.advance(item.size)
                elif item.name == META_NAME:
                    raw = reader.read_all(member)
                    _check_digest(name, hashlib.sha256(raw).hexdigest(), item.sha256)
                    metas[entry.tag] = check_meta(entry, raw, identity)
                    if target is not None:
                        _write_small(target, raw)
                else:
                    digest = _copy(reader.stream(member), target, item.size, meter)
                    _check_digest(name, digest, item.sha256)
                written[name] = (item.sha256, item.size, directory / item.name)
            own = {f.name for f in entry.files}
            if extracting:
                for item in entry.content_files:
                    try:
                        disk.check_packed(directory / item.name, own, known_files)
                    except UnsafeDisk as exc:
                        raise PackError(str(exc)) from None
                fsync_dir(directory)
            known_files[entry.tag] = own
        extra = reader.next()
        if extra is not None:
            raise PackError(f"member {extra.name!r} is not listed in the manifest")
        progress(meter.line())
        return manifest, {tag: meta for tag, meta in metas.items() if tag not in plan.reuse}
    finally:
        reader.close()


def _check_member(member: tarfile.TarInfo, expected: str, item: PackFile,
                  written: dict[str, tuple[str, int, Path]]) -> None:
    """Refuse a member that is not exactly the next file the manifest lists, saying why."""
    check_member_path(member.name)
    if member.name in written:
        raise PackError(f"duplicate member {member.name!r}")
    if member.issym():
        outside = member.linkname.startswith("/") or ".." in member.linkname.split("/")
        raise PackError(f"member {member.name!r} is a symbolic link to {member.linkname!r}"
                        + (", pointing out of the pack" if outside else "") + "; packs hold no symbolic links")
    if member.ischr() or member.isblk() or member.isfifo():
        raise PackError(f"member {member.name!r} is a device or FIFO; packs hold only regular files")
    if member.islnk():
        target = written.get(member.linkname)
        if target is None:
            raise PackError(f"member {member.name!r} is a hard link to {member.linkname!r}, which points out of "
                            "the pack (links may only name an earlier file of the pack)")
        if target[:2] != (item.sha256, item.size):
            raise PackError(f"member {member.name!r} is a hard link to {member.linkname!r}, whose content differs "
                            "from what the manifest lists for it")
    elif not member.isreg():
        raise PackError(f"member {member.name!r} is not a regular file; packs hold only regular files")
    if member.name != expected:
        raise PackError(f"member {member.name!r} is not the next file the manifest lists ({expected!r})")
    if member.isreg() and member.size != item.size:
        raise PackError(f"member {member.name!r} holds {member.size} bytes, the manifest says {item.size}")


def _check_digest(name: str, actual: str, declared: str) -> None:
    if actual != declared:
        raise PackError(f"{name}: SHA-256 {actual[:16]}… does not match the manifest's {declared[:16]}…; "
                        "the pack is damaged or was tampered with")


def _write_small(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())


def _copy(chunks: Iterable[bytes], target: Path | None, size: int, meter: Meter) -> str:
    """Hash ``chunks`` and write them to ``target`` with aligned zero runs left as holes."""
    digest = hashlib.sha256()
    if target is None:
        for chunk in chunks:
            digest.update(chunk)
            meter.advance(len(chunk))
        return digest.hexdigest()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        offset = 0
        for chunk in chunks:
            digest.update(chunk)
            _write_sparse(fd, chunk, offset)
            offset += len(chunk)
            meter.advance(len(chunk))
        os.ftruncate(fd, size)  # a trailing hole is only a size
        os.fsync(fd)
        os.fchmod(fd, 0o400)  # children map these; nobody writes them again
    finally:
        os.close(fd)
    return digest.hexdigest()


def _write_sparse(fd: int, data: bytes, offset: int) -> None:
    """Write ``data`` at ``offset``, skipping all-zero blocks (a new file reads back zeros there).

    Blocks are aligned to the file so the holes land on filesystem block boundaries. (Comparing
    bytes slices is a memcmp; comparing memoryviews goes element by element, 70 times slower.)
    """
    start = 0
    run_start: int | None = None  # start of the current run of non-zero blocks
    while start < len(data):
        end = min(len(data), start - (offset + start) % HOLE_BLOCK + HOLE_BLOCK)
        zero = data[start:end] == _ZEROS[:end - start]
        if zero and run_start is not None:
            _pwrite_all(fd, memoryview(data)[run_start:start], offset + run_start)
            run_start = None
        elif not zero and run_start is None:
            run_start = start
        start = end
    if run_start is not None:
        _pwrite_all(fd, memoryview(data)[run_start:], offset + run_start)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """What a client is told about a pack: its chain and identity."""
    return {"format_version": manifest.format_version, "top": manifest.top.tag,
            "chain": [{"tag": s.tag, "parent_tag": s.parent_tag, "digest": s.digest} for s in manifest.snapshots],
            "identity": manifest.identity, "bytes": manifest.total_bytes()}
