"""Digests a snapshot is published without: computed after publishing, off the caller's path.

A full BRANCH's memory file is a gigabyte; its SHA-256 alone (~0.6 s here, SHA-256 being sequential)
was most of what the caller waited for. So the branch publishes as soon as the file is written and
fsynced, with that file's digest recorded as :data:`PENDING`, and the digest is computed here, on one
thread of its own (never asyncio's default pool nor the store's: forks and the store's short work
wait on those). Then ``meta.json`` and the record get the digest, in that order, only if the record is
still the one published (compare and set): a snapshot removed (or replaced) meanwhile gets nothing.

What the record never carries is a wrong digest: ``pending`` is not a digest, and
:func:`forkd.store.chains.layer_digest` refuses it (:class:`DigestPending`), so any consumer that needs the
digest waits here first (:meth:`PendingDigests.wait` / :meth:`PendingDigests.settled`) or fails loudly.
Forks do not wait: a pending file is trusted while its stat is the one it had when it was published
(the same check :class:`forkd.store.files.DigestCache` gives every hashed file), and the hash refuses a
file whose stat moved. A daemon that stopped with a digest pending computes it again at start
(:meth:`PendingDigests.resume`); nothing can have read it as a digest meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.store.errors import SnapshotCorrupt, SnapshotError
from forkd.store.files import DigestCache, Version, file_version, write_json_atomic
from forkd.store.layers import data_extents
from forkd.store.layout import META_FILE
from forkd.store.registry import Registry, SnapshotRecord

log = logging.getLogger(__name__)

PENDING = "pending"  # the value of a file's digest in meta["sha256"] until it is computed


class DigestPending(SnapshotError):
    """A digest was asked of a snapshot whose digests are still being computed (a bug: wait first)."""

    kind = "conflict"


def pending_files(meta: dict[str, Any]) -> list[str]:
    """The files of a snapshot whose digest is still being computed."""
    return sorted(name for name, digest in meta.get("sha256", {}).items() if digest == PENDING)


@dataclass
class _Job:
    path: Path  # the snapshot's directory as published
    created_at: float  # with the tag, which snapshot it is: one removed and made again under its tag is another
    versions: dict[str, Version]  # of each pending file when it was published
    done: Future[None]


class PendingDigests:
    """The digests being computed, by snapshot tag; at most ``threads`` files hashed at once."""

    def __init__(self, registry: Registry, digests: DigestCache, threads: int = 1,
                 hash_file: Callable[[Path], str] | None = None) -> None:
        self.registry = registry
        self.digests = digests
        self._hash = hash_file or sha256_sparse  # a seam for tests that hold a hash back
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="forkd-digest")
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    def start(self, record: SnapshotRecord) -> None:
        """Compute the pending digests of ``record`` (just published; its files as they are now)."""
        names = pending_files(record.meta)
        if not names:
            return
        versions = {name: file_version(record.path / name) for name in names}
        with self._lock:
            running = self._jobs.get(record.tag)
            if running is not None and _same(running, record):
                return  # already under way (one removed under this tag meanwhile finds its record gone)
            job = _Job(path=record.path, created_at=record.created_at, versions=versions, done=Future())
            self._jobs[record.tag] = job
        self._pool.submit(self._run, record.tag, job)

    def resume(self) -> list[str]:
        """At start: compute again every digest a stopped daemon left pending. Returns their tags."""
        started = []
        for record in self.registry.list_snapshots():
            if record.status == "ready" and pending_files(record.meta):
                self.start(record)
                started.append(record.tag)
        return started

    def trusted(self, record: SnapshotRecord, name: str) -> bool:
        """Whether pending file ``name`` of ``record`` is still exactly as it was published (stat unchanged)."""
        with self._lock:
            job = self._jobs.get(record.tag)
        if job is None or not _same(job, record) or name not in job.versions:
            return False
        try:
            return file_version(record.path / name) == job.versions[name]
        except OSError:
            return False

    def wait(self, tag: str, timeout: float | None = None) -> SnapshotRecord | None:
        """Blocking: ``tag``'s record once none of its digests is pending (``None`` if it went away).
        Raises :class:`SnapshotCorrupt` if its file changed before it was hashed."""
        while True:
            record = self.registry.get_snapshot(tag)
            if record is None or record.status != "ready" or not pending_files(record.meta):
                if record is not None and record.status == "failed" and pending_files(record.meta):
                    raise SnapshotCorrupt(f"snapshot {tag!r}: {record.error}")
                return record
            with self._lock:
                job = self._jobs.get(tag)
            if job is None:  # left pending by a daemon that stopped, and not resumed yet
                self.start(record)
                continue
            job.done.result(timeout)

    async def settled(self, tag: str) -> SnapshotRecord | None:
        """:meth:`wait` for the event loop: the waiting holds no thread."""
        while True:
            record = self.registry.get_snapshot(tag)
            if record is None or record.status != "ready" or not pending_files(record.meta):
                return await asyncio.to_thread(self.wait, tag)  # raises as wait does; returns at once
            with self._lock:
                job = self._jobs.get(tag)
            if job is None:
                self.start(record)
                continue
            await asyncio.wrap_future(job.done)

    def busy(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, tag: str, job: _Job) -> None:
        try:
            digests = {name: self._hashed(job.path / name, version) for name, version in job.versions.items()}
            self._settle(tag, job, digests)
        except FileNotFoundError:
            log.info("snapshot %s was removed before its digests were computed", tag)
        except Exception as exc:  # noqa: BLE001 - the record must not stay pending forever, nor carry a digest
            self._fail(tag, job, str(exc) or type(exc).__name__)
        finally:
            with self._lock:
                if self._jobs.get(tag) is job:
                    del self._jobs[tag]
            job.done.set_result(None)

    def _hashed(self, path: Path, published: Version) -> str:
        if file_version(path) != published:
            raise SnapshotCorrupt(f"{path.name} was modified after it was published, before it was hashed")
        digest = self._hash(path)
        if file_version(path) != published:
            raise SnapshotCorrupt(f"{path.name} was modified while it was hashed")
        self.digests.remember(path, digest)  # a fork after this does not hash it again
        return digest

    def _settle(self, tag: str, job: _Job, digests: dict[str, str]) -> None:
        """``meta.json`` first, then the record, and only if the record is still the one published."""
        record = self.registry.get_snapshot(tag)
        if record is None or not _same(job, record) or set(pending_files(record.meta)) != set(job.versions):
            log.info("snapshot %s was removed or replaced before its digests were computed", tag)
            return
        meta = {**record.meta, "sha256": {**record.meta["sha256"], **digests}}
        write_json_atomic(job.path / META_FILE, meta)  # FileNotFoundError: removed meanwhile
        if not self.registry.replace_snapshot_meta(tag, job.created_at, record.meta, meta):
            log.info("snapshot %s was removed before its digests were recorded", tag)

    def _fail(self, tag: str, job: _Job, error: str) -> None:
        record = self.registry.get_snapshot(tag)
        if record is None or not _same(job, record) or not pending_files(record.meta):
            return
        log.error("snapshot %s: computing its digests failed: %s", tag, error)
        self.registry.update_snapshot(tag, status="failed", error=f"computing its digests failed: {error}")


_CHUNK = 4 << 20
_ZEROS = bytes(_CHUNK)


def sha256_sparse(path: Path) -> str:
    """The plain SHA-256 of a file's bytes, its holes hashed from a zero buffer instead of read (a
    memory file is mostly holes: reading them is a kernel copy of zeros per page)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        done = 0
        for start, end in [*data_extents(path), (size, size)]:
            while done < min(start, size):  # a hole
                n = min(_CHUNK, start - done)
                digest.update(_ZEROS[:n] if n < _CHUNK else _ZEROS)
                done += n
            while done < min(end, size):
                chunk = os.pread(f.fileno(), min(_CHUNK, end - done), done)
                if not chunk:
                    raise SnapshotCorrupt(f"{path.name} became shorter while it was hashed")
                digest.update(chunk)
                done += len(chunk)
    return digest.hexdigest()


def _same(job: _Job, record: SnapshotRecord) -> bool:
    """Whether ``record`` is the snapshot ``job`` hashes (not another made under its tag since)."""
    return record.path == job.path and record.created_at == job.created_at
