"""Memory layers: the guest pages a diff snapshot changed relative to its parent, and nothing else.

A diff snapshot's memory is its chain's base memory file with every layer from the base up laid
over it. A layer file is::

    b"FORKDLAY" | u32 version | u32 page size | u64 count | count × u64 page offsets (ascending)
    | count × page data

Pages the child zeroed are stored as data too (rare, and it keeps one code path). A layer is written
from :class:`forkd.vmm.base.Pages` a BRANCH copied out of the VMM (its private pages), less those equal to what the
parent's children already see. Memory files are read through their data extents
(``SEEK_DATA``/``SEEK_HOLE``), so flattening a 1 GiB file with 150 MB written reads 150 MB; the
flattened file's SHA-256 is computed in that same pass (:func:`flatten`), so it is never read back.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import struct
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from forkd.vmm.base import PAGE_SIZE, Pages, page_runs

MAGIC = b"FORKDLAY"
VERSION = 1
_HEADER = struct.Struct("<8sIIQ")
_CHUNK = 1 << 20  # flattened, hashed and compared a MiB at a time; only unequal MiBs page by page
_ZERO = bytes(_CHUNK)


class LayerError(ValueError):
    """A layer file is not in the format above."""


@dataclass(frozen=True)
class Layer:
    """The index of one layer file: which page offsets it holds, and where their data starts."""

    path: Path
    page_size: int
    offsets: array  # unsigned 64-bit page offsets into guest RAM, ascending
    sha256: str = ""  # of the file, when this process wrote it (write_layer); read_layer does not hash

    @property
    def data_start(self) -> int:
        return _HEADER.size + 8 * len(self.offsets)

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """``(guest offset, position in the file, length)`` of each run of adjacent pages."""
        return page_runs(self.offsets, self.page_size, self.data_start)


def read_layer(path: Path) -> Layer:
    with open(path, "rb") as f:
        header = f.read(_HEADER.size)
        if len(header) != _HEADER.size:
            raise LayerError(f"{path} is too short to be a memory layer")
        magic, version, page_size, count = _HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            raise LayerError(f"{path} is not a forkd memory layer (version {VERSION})")
        offsets = array("Q")
        offsets.frombytes(f.read(8 * count))
    if len(offsets) != count or os.path.getsize(path) != _HEADER.size + count * (8 + page_size):
        raise LayerError(f"{path} is truncated")
    return Layer(path=path, page_size=page_size, offsets=offsets)


def data_extents(path: Path) -> list[tuple[int, int]]:
    """``(start, end)`` of the parts of a sparse file that hold data."""
    extents = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole remains
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, end))
            pos = end
    finally:
        os.close(fd)
    return extents


class ChainMemory:
    """Reads the memory a chain's children see: a base file with layers laid over it, base first."""

    def __init__(self, base: Path, layers: list[Layer]) -> None:
        self.base = base
        self.layers = layers
        self._pages: dict[int, tuple[int, int]] = {}  # guest offset → (layer index, file position)
        for index, layer in enumerate(layers):
            for i, offset in enumerate(layer.offsets):
                self._pages[offset] = (index, layer.data_start + i * layer.page_size)

    def read(self, fds: list[int], base_fd: int, offset: int, length: int) -> bytearray:
        """A bytearray: it compares to any buffer (a VMM's pages) with memcmp, a memoryview does not."""
        data = bytearray(length)
        os.preadv(base_fd, [data], offset)  # beyond the base's end stays zero
        if self._pages:
            for page in range(offset, offset + length, PAGE_SIZE):
                hit = self._pages.get(page)
                if hit is not None:
                    data[page - offset:page - offset + PAGE_SIZE] = os.pread(fds[hit[0]], PAGE_SIZE, hit[1])
        return data


def drop_unchanged(pages: Pages, parent: ChainMemory) -> Pages:
    """The pages that differ from what ``parent``'s children see (zeroed ones included).

    When none is dropped the pages are returned as they are; else the kept ones are copied once
    into a buffer of their size. (A BRANCH does not copy them: :func:`write_layer` with ``parent``.)
    """
    offsets, runs = _kept(pages, parent)
    if len(offsets) == len(pages.offsets):
        return pages
    kept = memoryview(bytearray(PAGE_SIZE * len(offsets)))
    at = 0
    for position, length in runs:
        kept[at:at + length] = pages.data[position:position + length]
        at += length
    return Pages(offsets=offsets, data=kept)


def _kept(pages: Pages, parent: ChainMemory) -> tuple[array, list[tuple[int, int]]]:
    """Offsets of the pages that differ from ``parent``'s, and where they lie in ``pages.data``, as
    ``(position, length)`` runs of adjacent ones: a run compared equal as a whole costs one memcmp."""
    offsets = array("Q")
    runs: list[tuple[int, int]] = []
    fds = [os.open(layer.path, os.O_RDONLY) for layer in parent.layers]
    base_fd = os.open(parent.base, os.O_RDONLY)
    try:
        for guest_offset, position, length in pages.runs():
            changed = _changed_pages(parent.read(fds, base_fd, guest_offset, length), 0,
                                     pages.data[position:position + length])
            if len(changed) * PAGE_SIZE == length:  # the usual case: every page of the run was rewritten
                offsets.extend(range(guest_offset, guest_offset + length, PAGE_SIZE))
                changed_runs: Iterable[tuple[int, int]] = ((position, length),)
            else:
                offsets.extend(guest_offset + page for page in changed)
                changed_runs = ((position + page, PAGE_SIZE) for page in changed)
            for at, size in changed_runs:
                if runs and runs[-1][0] + runs[-1][1] == at:
                    runs[-1] = (runs[-1][0], runs[-1][1] + size)
                else:
                    runs.append((at, size))
    finally:
        for fd in (*fds, base_fd):
            os.close(fd)
    return offsets, runs


def write_layer(path: Path, pages: Pages, parent: ChainMemory | None = None) -> Layer:
    """Write ``pages`` as a layer file (fsynced); with ``parent``, only those that differ from its.

    The kept pages go from ``pages.data`` through reused 1 MiB buffers (no copy of the whole set),
    each hashed in a second thread while the next is filled; writeback starts every 16 MiB, so
    the fsync at the end waits for little.
    """
    if parent is None:
        offsets, runs = pages.offsets, [(0, PAGE_SIZE * len(pages.offsets))]
    else:
        offsets, runs = _kept(pages, parent)
    parts: Iterator[memoryview | bytes] = itertools.chain(
        (_HEADER.pack(MAGIC, VERSION, PAGE_SIZE, len(offsets)), memoryview(offsets).cast("B")),
        (pages.data[position:position + length] for position, length in runs))
    with open(path, "wb") as out, _Hasher() as hasher:
        fd, written, flushed = out.fileno(), 0, 0
        buf, fill = hasher.buffer(_CHUNK), 0
        for part in parts:
            while part:
                n = min(len(part), _CHUNK - fill)
                buf[fill:fill + n] = part[:n]
                part, fill = part[n:], fill + n
                if fill == _CHUNK:
                    _write_all(fd, buf)
                    hasher.update(buf, lent=True)
                    written += _CHUNK
                    if written - flushed >= _WRITEBACK:
                        _start_writeback(fd, flushed, written - flushed)
                        flushed = written
                    buf, fill = hasher.buffer(_CHUNK), 0
        tail = buf[:fill]
        _write_all(fd, tail)
        hasher.update(tail)
        os.fsync(fd)
        digest = hasher.hexdigest()
    return Layer(path=path, page_size=PAGE_SIZE, offsets=offsets, sha256=digest)


def _write_all(fd: int, data: bytearray | memoryview) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.write(fd, view[done:])


@dataclass(frozen=True)
class Flattened:
    """What :func:`flatten` wrote: the file's SHA-256, and how many of the top pages differ from the chain."""

    sha256: str
    changed_pages: int


def flatten(memory: ChainMemory, dest: Path, top: Pages | None = None, digest: bool = True) -> Flattened:
    """Write what ``memory``'s children see, with ``top`` (pages copied out of a VMM) laid over it, into
    one sparse file, and hash it in the same pass.

    One sequential walk over guest RAM a chunk at a time: the base file's data extents, then each
    layer's pages, then ``top``'s, are read into the chunk; the chunk is hashed and its data written.
    Chunks nothing holds data in (holes of the base, no page laid over them) are hashed from a zero
    buffer and left as holes, as are chunks that came out all zero. So the new file is never read
    back to hash it: the digest is the plain SHA-256 of its bytes, the same a later
    :func:`forkd.store.files.sha256_file` finds. Hashing runs in a second thread, behind the writing
    (hashlib releases the GIL); writeback starts every 16 MiB written, and the file is fsynced
    before it returns. ``digest=False``: not hashed at all (``sha256`` is empty): a BRANCH publishes
    first and hashes after (``forkd.store.pending``), since SHA-256 of a GiB is most of the work here.
    """
    size = os.path.getsize(memory.base)
    pieces: dict[int, list[_Piece]] = {}  # chunk index → what is laid over it, in order
    fds = [os.open(layer.path, os.O_RDONLY) for layer in memory.layers]
    try:
        for layer, fd in zip(memory.layers, fds):
            for guest_offset, position, length in layer.runs():
                _split(pieces, guest_offset, length, lambda at, n, src=position - guest_offset, fd=fd:
                       _Piece(at, n, fd=fd, position=src + at))
        if top is not None:
            for guest_offset, position, length in top.runs():
                if guest_offset + length > size:
                    raise LayerError(f"a page at {guest_offset:#x} lies beyond the memory of {memory.base}")
                _split(pieces, guest_offset, length, lambda at, n, src=position - guest_offset:
                       _Piece(at, n, data=top.data[src + at:src + at + n]))
        extents = data_extents(memory.base)
        for start, end in extents:
            _split(pieces, start, min(end, size) - start, lambda at, n: _Piece(at, n, base=True))
        with open(memory.base, "rb") as src, open(dest, "wb") as out, (_Hasher() if digest else _NoHash()) as hasher:
            out.truncate(size)
            changed = 0
            flushed = 0  # written data before this offset is on its way to disk
            for chunk in range(0, size, _CHUNK):
                laid = pieces.get(chunk // _CHUNK)
                if not laid:
                    hasher.zero(min(_CHUNK, size - chunk))
                    continue
                buf = hasher.buffer(min(_CHUNK, size - chunk))
                view = memoryview(buf)
                laid.sort(key=lambda piece: not piece.base)  # the base first, then layers and top in order
                if not digest:  # the buffer was not zeroed (a MiB memset per chunk): only where top pages go
                    for piece in laid:
                        if piece.data is not None:
                            view[piece.at - chunk:piece.at - chunk + piece.length] = _ZERO[:piece.length]
                for piece in laid:
                    at, end = piece.at - chunk, piece.at - chunk + piece.length
                    if piece.base:
                        os.preadv(src.fileno(), [view[at:end]], piece.at)
                    elif piece.data is None:
                        os.preadv(piece.fd, [view[at:end]], piece.position)
                    else:
                        changed += len(_changed_pages(buf, at, piece.data))
                        view[at:end] = piece.data
                ranges = list(_merged((p.at - chunk, p.at - chunk + p.length) for p in laid))
                # Hashed, the buffer is zero outside the pieces; not hashed, only the pieces are known.
                if (buf != _ZERO[:len(buf)]) if digest else any(buf[a:b] != _ZERO[:b - a] for a, b in ranges):
                    for at, end in ranges:
                        os.pwrite(out.fileno(), view[at:end], chunk + at)
                    if chunk + _CHUNK - flushed >= _WRITEBACK:
                        _start_writeback(out.fileno(), flushed, chunk + _CHUNK - flushed)
                        flushed = chunk + _CHUNK
                hasher.update(buf, lent=True)
            hexdigest = hasher.hexdigest()
            out.flush()
            os.fsync(out.fileno())
    finally:
        for fd in fds:
            os.close(fd)
    return Flattened(sha256=hexdigest, changed_pages=changed)


@dataclass(frozen=True)
class _Piece:
    """A part of one chunk: guest offset ``at``, ``length`` bytes, from the base, a layer file or memory."""

    at: int
    length: int
    base: bool = False
    fd: int = -1
    position: int = 0
    data: memoryview | None = None


def _split(pieces: dict[int, list[_Piece]], offset: int, length: int,
           make: Callable[[int, int], _Piece]) -> None:
    """File ``[offset, offset + length)`` under the chunks it spans, as ``make(at, length)`` per chunk."""
    end = offset + length
    while offset < end:
        stop = min(end, (offset // _CHUNK + 1) * _CHUNK)
        pieces.setdefault(offset // _CHUNK, []).append(make(offset, stop - offset))
        offset = stop


def _merged(ranges: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """Overlapping or touching ranges as one."""
    current: tuple[int, int] | None = None
    for start, end in sorted(ranges):
        if current is not None and start <= current[1]:
            current = (current[0], max(current[1], end))
            continue
        if current is not None:
            yield current
        current = (start, end)
    if current is not None:
        yield current


def _changed_pages(old: bytearray, at: int, new: memoryview) -> list[int]:
    """Positions in ``new`` of the pages that differ from ``old`` at ``at`` (a bytearray on the left
    compares to any buffer with memcmp; a memoryview compares item by item, 100 times slower)."""
    if (old if at == 0 and len(old) == len(new) else old[at:at + len(new)]) == new:
        return []
    return [p for p in range(0, len(new), PAGE_SIZE) if old[at + p:at + p + PAGE_SIZE] != new[p:p + PAGE_SIZE]]


class _Hasher:
    """SHA-256 fed from a worker thread, in order, with at most a few chunks waiting; it lends the
    chunk buffers too, so a buffer is filled again only once it was hashed."""

    _WAITING = 8

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flatten-hash")
        self._pending: deque[tuple[Future[None], bytearray | None]] = deque()
        self._free: list[bytearray] = []

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def buffer(self, length: int) -> bytearray:
        """A zeroed buffer of ``length`` bytes to fill and pass to :meth:`update`."""
        if length != _CHUNK:
            return bytearray(length)
        while not self._free and len(self._pending) >= self._WAITING:
            self._retire()
        if not self._free:
            return bytearray(_CHUNK)
        buf = self._free.pop()
        buf[:] = _ZERO
        return buf

    def update(self, data: bytes | bytearray | memoryview, lent: bool = False) -> None:
        """Hash ``data`` next; ``lent``: a :meth:`buffer`, taken back once hashed."""
        self._submit(data, data if lent and isinstance(data, bytearray) and len(data) == _CHUNK else None)

    def zero(self, length: int) -> None:
        self._submit(_ZERO if length == _CHUNK else bytes(length), None)

    def hexdigest(self) -> str:
        while self._pending:
            self._retire()
        return self._hash.hexdigest()

    def _submit(self, data: bytes | bytearray | memoryview, lent: bytearray | None) -> None:
        while len(self._pending) >= self._WAITING:
            self._retire()
        self._pending.append((self._pool.submit(self._hash.update, data), lent))

    def _retire(self) -> None:
        done, lent = self._pending.popleft()
        done.result()
        if lent is not None:
            self._free.append(lent)


class _NoHash(_Hasher):
    """A :class:`_Hasher` that hashes nothing: one buffer, filled again as soon as it was written, and
    not zeroed (:func:`flatten` zeroes only where top pages are compared; it writes only the pieces)."""

    def __init__(self) -> None:
        self._buf = bytearray(_CHUNK)

    def __exit__(self, *exc: object) -> None:
        pass

    def buffer(self, length: int) -> bytearray:
        return self._buf if length == _CHUNK else bytearray(length)

    def update(self, data: bytes | bytearray | memoryview, lent: bool = False) -> None:
        pass

    def zero(self, length: int) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


_WRITEBACK = 16 << 20  # a flattened file's data is sent to disk every 16 MiB written, so the fsync at the end is short
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``[offset, offset + length)`` of ``fd`` to disk without waiting (``sync_file_range``)."""
    if _libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot start writing back a flattened memory file: {os.strerror(err)}")


_FALLOC_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_libc.sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def punch_zero_pages(path: Path) -> int:
    """Turn written all-zero pages back into holes; returns the bytes freed.

    On tmpfs a VMM reading a hole through a shared mapping allocates it, so a memory file loaded
    there occupies all of guest RAM; on ext4 it stays sparse and this finds little to do.
    """
    zero = _ZERO
    freed = 0
    fd = os.open(path, os.O_RDWR)
    try:
        for start, end in data_extents(path):
            for pos in range(start, end, _CHUNK):
                length = min(_CHUNK, end - pos)
                data = os.pread(fd, length, pos)
                if data == zero[:length]:
                    runs = [(pos, length)]
                else:
                    runs = [(pos + p, PAGE_SIZE) for p in range(0, length, PAGE_SIZE)
                            if data[p:p + PAGE_SIZE] == zero[:PAGE_SIZE]]
                for offset, size in runs:
                    if _libc.fallocate(fd, _FALLOC_PUNCH, offset, size) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"cannot punch holes in {path}: {os.strerror(err)}")
                    freed += size
    finally:
        os.close(fd)
    return freed
