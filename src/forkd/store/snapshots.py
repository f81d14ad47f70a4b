"""The snapshot store: the one owner of snapshot tags, directories, registration and chains.

Every way a snapshot comes to exist — create (bake), BRANCH, compact, snapshot-diff, unpack/pull —
goes through the same steps here:

1. **Claim** its tag (:meth:`SnapshotStore.claim`): one claim per tag at a time, checked against the
   claims held and the registry in one step, so a second create/branch/compact/unpack of the tag is
   refused at once (``SnapshotConflict``, HTTP 409) instead of racing the first.
2. **Build** in a hidden ``snapshots/.build-*`` directory (:meth:`build_dir`); files are sealed
   (read-only, hashed) with :meth:`seal`.
3. **Publish** (:meth:`publish`): files and directory fsynced, renamed into place with
   ``RENAME_NOREPLACE`` (whatever sits at the destination is refused, never removed), the parent
   directory fsynced, then registered — files first, record second, so a registered snapshot always
   has its files. A failure puts everything back.

Whatever a dead daemon left mid-way (build directories, unregistered snapshot directories,
``writing`` records) is cleaned by the one reaper, :meth:`reap`, run at start.

A snapshot's parent link is the registry's ``parent_tag`` column, nothing else. Opening a
snapshot checks its format version, that this host can restore it, its chain and every file's
digest (:meth:`open`). The disk layer's file name is the VMM backend's (``disk``, a
:class:`forkd.vmm.disk.DiskFormat`); the store never looks inside a disk.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.guest.protocol import AGENT_VERSION
from forkd.store.chains import (
    ChainBroken,
    ancestry,
    chain_memory,
    descendants,
    parent_digests,
    record_digest,
)
from forkd.store.errors import (
    DigestNotFound,
    SnapshotConflict,
    SnapshotCorrupt,
    SnapshotError,
)
from forkd.store.files import (
    RENAME_NOREPLACE,
    DigestCache,
    fsync_dir,
    fsync_tree,
    renameat2,
    write_json_atomic,
)
from forkd.store.io import blocking, remove_tree
from forkd.store.layers import LayerError, read_layer
from forkd.store.layout import (
    BUILD_PREFIX,
    FORMAT_VERSION,
    INITRD_FILE,
    KERNEL_FILE,
    META_FILE,
    OLDER_WORK_PREFIXES,
    STATE_FILE,
    snapshot_format,
)
from forkd.store.pending import PENDING, PendingDigests, pending_files
from forkd.store.registry import Registry, SnapshotRecord
from forkd.store.usage import directory_usage
from forkd.validation import check_tag, is_tag
from forkd.vmm.base import (
    BootSpec,
    MachineIdentity,
    SavedVm,
    SnapshotMismatch,
    machine_of,
)
from forkd.vmm.disk import DiskFormat

HostIdentity = Callable[[BootSpec], MachineIdentity]


def boot_spec(directory: Path, meta: dict[str, Any]) -> BootSpec:
    """The machine a snapshot's children must be started as."""
    return BootSpec(kernel=directory / KERNEL_FILE, initrd=directory / INITRD_FILE, **meta["boot"])


@dataclass(frozen=True)
class Claim:
    """Tags held by one request until it publishes or gives up; release it exactly once (``with``)."""

    store: SnapshotStore
    tags: tuple[str, ...]
    purpose: str  # "created", "branched", ...: how a refused claimant is told what holds the tag

    def release(self) -> None:
        self.store._release(self)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class SnapshotStore:
    def __init__(self, directory: Path, registry: Registry, digests: DigestCache, host_identity: HostIdentity,
                 disk: DiskFormat) -> None:
        self.directory = directory
        self.registry = registry
        self.digests = digests
        self.host_identity = host_identity
        self.disk = disk
        self._claims: dict[str, Claim] = {}
        self._lock = threading.Lock()  # claims are taken on the loop and released from worker threads
        self.pending = PendingDigests(registry, digests)  # digests computed after publishing (pending.py)

    # tags ------------------------------------------------------------------------------------------

    def claim(self, tags: str | Sequence[str], purpose: str, existing_ok: bool = False) -> Claim:
        """Hold ``tags`` for one request, all or none; refuses (409) a tag another request holds, and,
        unless ``existing_ok`` (an unpack that reuses or replaces snapshots), one that is registered.

        Synchronous, so an HTTP handler can claim before it answers, and a 409 comes before any streaming.
        """
        wanted = tuple(check_tag(t) for t in ([tags] if isinstance(tags, str) else tags))
        with self._lock:
            for tag in wanted:
                holder = self._claims.get(tag)
                if holder is not None:
                    raise SnapshotConflict(f"snapshot {tag!r} is being {holder.purpose} by another request; wait "
                                           "for it to finish or pick another tag")
                if not existing_ok and (existing := self.registry.get_snapshot(tag)) is not None:
                    raise SnapshotConflict(f"snapshot {tag!r} exists ({existing.status}); pick another tag or "
                                           f"remove it with `forkd rmi {tag}`")
            claim = Claim(self, wanted, purpose)
            self._claims.update(dict.fromkeys(wanted, claim))
        return claim

    def _release(self, claim: Claim) -> None:
        with self._lock:
            for tag in claim.tags:
                if self._claims.get(tag) is claim:
                    del self._claims[tag]

    def held_for(self, tag: str) -> str | None:
        """What a claim on ``tag`` is doing ("created", ...), or ``None`` if no request holds it."""
        with self._lock:
            claim = self._claims.get(tag)
        return None if claim is None else claim.purpose

    def _doing(self, tag: str) -> str | None:
        """What is being done to ``tag`` right now: a claim's purpose, or "written" for a record being written."""
        record = self.registry.get_snapshot(tag)
        return self.held_for(tag) or ("written" if record is not None and record.status == "writing" else None)

    # building --------------------------------------------------------------------------------------

    def build_dir(self, label: str) -> Path:
        """A fresh hidden work directory under the store: removed by the caller, or by :meth:`reap`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{BUILD_PREFIX}{label}-{secrets.token_hex(4)}"
        path.mkdir()
        return path

    def seal(self, directory: Path, names: Sequence[str], written: Mapping[str, str] | None = None,
             deferred: Sequence[str] = ()) -> dict[str, str]:
        """Make a new snapshot's files read-only and hash them as they now are on disk.

        ``written``: digests the builder computed over the bytes it just wrote (:func:`forkd.store.layers.flatten`
        returns one), so those files are not read again. The digests stay known for the read-only
        files, so a fork of the new snapshot does not hash them either. ``deferred``: files recorded
        as :data:`~forkd.store.pending.PENDING`, hashed after publishing (:meth:`publish` starts it).
        """
        digests = {}
        for name in names:
            path = directory / name
            if name in deferred:
                os.chmod(path, 0o400)
                digests[name] = PENDING
                continue
            if written and name in written:
                self.digests.remember(path, written[name])
            digests[name] = self.digests.sha256(path)
            self.digests.chmod(path, 0o400)  # children map these; nobody should write them again
        return digests

    def write_meta(self, directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
        """Write a new snapshot's ``meta.json`` (atomically, stamped with the format version); returns it."""
        meta = {**meta, "format": FORMAT_VERSION}
        write_json_atomic(directory / META_FILE, meta)
        return meta

    def register_writing(self, claim: Claim, record: SnapshotRecord) -> None:
        """Make a claimed snapshot visible as ``writing`` while it is built (forks of it get 409)."""
        self._check_claimed(claim, [record.tag])
        record.status = "writing"
        self.registry.add_snapshot(record)

    def mark_failed(self, tag: str, error: str) -> None:
        """A ``writing`` snapshot that will never be ready: kept, with its error, until removed."""
        self.registry.update_snapshot(tag, status="failed", error=error)

    # publishing ------------------------------------------------------------------------------------

    def publish(self, claim: Claim, entries: Sequence[tuple[Path, SnapshotRecord]],
                replacing: tuple[SnapshotRecord, Path] | None = None, head_of: str | None = None) -> None:
        """Put built directories in place as their records' tags and register them, root first, in one
        transaction; ``replacing`` (a record and where to move it) is set aside and unregistered.
        ``head_of``: the sandbox a branch was taken of, whose head moves to the last entry in that same
        transaction (a daemon dying in between would leave it chaining past this layer's disk).

        Blocking (fsync, renames): run it with :func:`forkd.store.io.blocking`. On any failure every
        directory is moved back where it was and nothing is registered.
        """
        records = [record for _, record in entries]
        self._check_claimed(claim, [r.tag for r in records])
        for build_dir, _ in entries:
            fsync_tree(build_dir)
        moved: list[tuple[Path, Path]] = []
        try:
            if replacing is not None:
                os.rename(replacing[0].path, replacing[1])
                moved.append((replacing[0].path, replacing[1]))
            for build_dir, record in entries:
                final = self.directory / record.tag
                self._rename_into_place(build_dir, final)
                moved.append((build_dir, final))
                record.path = final
            fsync_dir(self.directory)
            for record in records:
                record.status = "ready"
            self.registry.publish_snapshots(records, remove=(replacing[0].tag,) if replacing else (),
                                            head_of=(head_of, records[-1].tag) if head_of else None)
        except BaseException:
            for origin, now in reversed(moved):
                os.rename(now, origin)
            raise
        for record in records:
            self.pending.start(record)  # digests sealed as pending: computed from now on, on their own thread

    @staticmethod
    def _rename_into_place(build_dir: Path, final: Path) -> None:
        try:
            renameat2(build_dir, final, RENAME_NOREPLACE)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise SnapshotConflict(f"{final} exists but is no registered snapshot, so it was left alone; move it "
                                   "away (a restarted daemon removes such leftovers) and try again") from None

    def _check_claimed(self, claim: Claim, tags: Sequence[str]) -> None:
        with self._lock:
            unheld = [t for t in tags if self._claims.get(t) is not claim]
        if unheld:
            raise SnapshotError(f"internal error: snapshot {unheld[0]!r} is published without holding its tag")

    # reading ---------------------------------------------------------------------------------------

    def get(self, tag: str) -> SnapshotRecord:
        record = self.registry.get_snapshot(check_tag(tag))
        if record is None:
            raise LookupError(f"no snapshot {tag!r}; list them with `forkd snapshots`")
        return record

    def by_digest(self, digest: str) -> SnapshotRecord | None:
        """A ready snapshot whose layer digest is ``digest`` (tags are local names; digests travel).

        Blocking: snapshots whose digests are pending are waited for, so one just branched is found.
        """
        return next((r for r in self.settle(self.registry.list_snapshots())
                     if r.status == "ready" and "sha256" in r.meta and record_digest(r) == digest), None)

    def settle(self, records: Sequence[SnapshotRecord]) -> list[SnapshotRecord]:
        """``records`` as registered once none of their digests is pending (blocking; see pending.py).
        Left out: one removed meanwhile, and one that will never have its digest (its file changed
        before it was hashed: it is ``failed``), so no caller ever sees ``pending`` as a digest."""
        settled = []
        for record in records:
            if pending_files(record.meta):
                try:
                    now = self.pending.wait(record.tag) if record.status == "ready" else None
                except SnapshotCorrupt:
                    continue
                if now is None or pending_files(now.meta):
                    continue
                record = now
            settled.append(record)
        return settled

    def get_digest(self, digest: str) -> SnapshotRecord:
        record = self.by_digest(digest)
        if record is None:
            raise DigestNotFound(f"no snapshot with digest {digest} on this node; see the digests it holds in "
                                 "GET /v1/node, or pull it from a node that holds it (POST /v1/node/pull)")
        return record

    def settle_one(self, record: SnapshotRecord | None) -> SnapshotRecord | None:
        """:meth:`settle` of one record (``None``: none, or removed meanwhile)."""
        return next(iter(self.settle([record])), None) if record is not None else None

    def chain(self, tag: str) -> list[SnapshotRecord]:
        """The ready snapshot ``tag`` and its ancestors, top first (see :func:`ancestry`); digests may be pending."""
        record = self.get(tag)
        if record.status != "ready":
            raise SnapshotConflict(f"snapshot {tag!r} is {record.status}, not ready")
        return self.ancestry(record)

    def ancestry(self, record: SnapshotRecord) -> list[SnapshotRecord]:
        """``record`` and its ancestors, top first (see :func:`forkd.store.chains.ancestry`)."""
        return ancestry(self.registry, record, self.disk.file_name)

    def parent_digests(self, parent: SnapshotRecord) -> dict[str, str]:
        """What a snapshot branched from ``parent`` records of it (``parent_sha256``)."""
        return parent_digests(parent, self.disk.file_name)

    def open(self, tag: str) -> tuple[SnapshotRecord, SavedVm, BootSpec]:
        """The verified files and machine of a snapshot, ready to restore children from.

        Blocking (hashes files not hashed before): run it on a thread.
        """
        record = self.registry.get_snapshot(check_tag(tag))
        if record is None and self.held_for(tag):
            raise SnapshotConflict(f"snapshot {tag!r} is still being {self.held_for(tag)}; fork it when it is ready")
        if record is None:
            raise SnapshotError(f"no snapshot {tag!r}; create it with `forkd snapshot create --tag {tag}`")
        if record.status != "ready":
            raise SnapshotConflict(f"snapshot {tag!r} is {record.status}, not ready")
        identity = MachineIdentity.from_dict(record.meta["identity"])
        hint = f"create it again here with `forkd snapshot create --tag {tag}`"
        self.check_format(record.meta, f"snapshot {tag!r}", hint)
        self.check_machine(identity, f"snapshot {tag!r}", hint)  # before the chain: its disk is this backend's
        try:
            chain = self.ancestry(record)
        except ChainBroken as exc:
            raise SnapshotCorrupt(str(exc)) from None
        for link in chain:  # a stat per file and link: each file version is hashed once (DigestCache)
            self.verify(link)
        memory = chain_memory(chain)
        try:
            layers = tuple(read_layer(path) for path in memory.layers)
        except LayerError as exc:
            raise SnapshotCorrupt(f"snapshot {tag!r}: {exc}") from None
        saved = SavedVm(memory=memory.base, state=record.path / STATE_FILE, disk=record.path / self.disk.file_name,
                        identity=identity, layers=layers, state_format=record.meta.get("state_format", ""))
        return record, saved, boot_spec(record.path, record.meta)

    def verify(self, record: SnapshotRecord) -> None:
        """Every file of one snapshot still has the digest recorded when it was saved."""
        tag = record.tag
        if any(not self.pending.trusted(record, name) for name in pending_files(record.meta)):
            settled = self.pending.wait(tag)  # not as published: hashed first (which refuses a change), then checked
            if settled is None or pending_files(settled.meta):
                raise SnapshotCorrupt(f"snapshot {tag!r} was removed or failed while it was being verified")
            record = settled
        for name, digest in record.meta["sha256"].items():
            if digest == PENDING:  # exactly as published (stat unchanged): what DigestCache trusts too
                continue
            try:
                actual = self.digests.sha256(record.path / name)
            except OSError as exc:
                raise SnapshotCorrupt(f"snapshot {tag!r} is missing {name} ({exc}); remove it with "
                                      f"`forkd rmi {tag}`") from None
            if actual != digest:
                raise SnapshotCorrupt(f"snapshot {tag!r}: {name} was modified after it was saved (SHA-256 "
                                      f"{actual[:12]}… ≠ recorded {digest[:12]}…); remove it with `forkd rmi {tag}` "
                                      "and create it again")

    def check_format(self, meta: dict[str, Any], what: str, hint: str) -> None:
        """Refuse a snapshot written in a newer format than this daemon reads."""
        version = snapshot_format(meta)
        if version > FORMAT_VERSION:
            raise SnapshotMismatch(f"{what} is in snapshot format {version}; this forkd reads up to "
                                   f"{FORMAT_VERSION}: upgrade forkd, or {hint}")

    def check_machine(self, identity: MachineIdentity, what: str, hint: str) -> None:
        """Refuse a snapshot this host cannot restore, naming every field of the machine that differs."""
        host = self.host_identity(BootSpec(kernel=Path(), initrd=Path(), cmdline="", memory_mib=identity.memory_mib,
                                           vcpus=identity.vcpus, kernel_sha256=identity.kernel_sha256,
                                           agent_version=AGENT_VERSION, machine=machine_of(identity.machine)))
        differences = identity.differences(host)
        if differences:
            raise SnapshotMismatch(f"{what} was saved on a different machine and cannot be restored here: "
                                   + "; ".join(differences) + f"; {hint}")

    async def listing(self) -> list[dict[str, Any]]:
        """Every snapshot with what its directory holds on disk (a tree walk each, off the loop)."""
        def walk() -> list[dict[str, Any]]:
            return [{**r.to_dict(), "disk": directory_usage(r.path)} for r in self.registry.list_snapshots()]
        return await blocking(walk)

    # removing --------------------------------------------------------------------------------------

    async def remove(self, tag: str, live_children: Callable[[str], int], cascade: bool = False,
                     force: bool = False) -> list[str]:
        """Remove a snapshot; with ``cascade`` also every snapshot branched from it. Returns the tags removed.

        Without ``cascade`` or ``force`` a snapshot others were branched from is kept: removing it
        would leave them unusable. ``force`` removes it anyway (its dependents then refuse to fork).
        Records and names go at once; the files are deleted afterwards, off the event loop.
        """
        record = self.get(tag)
        dependents = descendants(self.registry, record.tag)
        if dependents and not (cascade or force):
            raise SnapshotConflict(f"snapshot {tag!r} has dependents {', '.join(sorted(dependents))}; remove them "
                                   f"too with `forkd rmi --cascade {tag}`, or orphan them with `--force`")
        doomed = [*dependents, record.tag] if cascade else [record.tag]
        busy = []
        for victim in doomed:
            if live := live_children(victim):
                busy.append(f"{victim!r} ({live} live sandboxes)")
            elif doing := self._doing(victim):
                busy.append(f"{victim!r} (being {doing})")
        if busy:
            raise SnapshotConflict(f"snapshots in use: {', '.join(busy)}; kill the sandboxes or wait, then remove again")
        with self.claim(doomed, "removed", existing_ok=True):  # taken before any wait: no fork starts now
            trash = self.build_dir("remove")
            await blocking(self._unregister, doomed, trash)
        await remove_tree(trash)
        return doomed

    def _unregister(self, doomed: list[str], trash: Path) -> None:
        """Drop the records and move the directories into ``trash``, deepest first: a crash in
        between never leaves a child without its parent."""
        for victim in doomed:
            path = self.registry.get_snapshot(victim).path  # type: ignore[union-attr]
            self.registry.remove_snapshot(victim)
            if path.exists():
                os.rename(path, trash / victim)  # gone from its name at once; deleted afterwards

    # recovery --------------------------------------------------------------------------------------

    def reap(self) -> list[str]:
        """What a dead daemon left: ``writing`` records become ``failed``; build directories and
        directories no record names are removed (nothing can use them); digests left pending are
        computed again, in the background (pending.py). Returns the names removed.

        Blocking; run at start, before anything claims a tag.
        """
        for record in self.registry.list_snapshots():
            if record.status == "writing" and self.held_for(record.tag) is None:
                self.mark_failed(record.tag, "the daemon stopped while writing it")
        registered = {r.path.name for r in self.registry.list_snapshots()}
        removed = []
        for entry in sorted(self.directory.iterdir()) if self.directory.exists() else ():
            # Only names forkd makes: a filesystem's own lost+found (a mount point) is left alone.
            ours = (entry.name.startswith((BUILD_PREFIX, *OLDER_WORK_PREFIXES))
                    or (is_tag(entry.name) and entry.name not in registered))
            if ours and entry.is_dir() and not entry.is_symlink() and not self.held_for(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        self.pending.resume()
        return removed
