"""Packing, unpacking, pulling and pushing snapshots: the daemon side, which owns the store.

Unpacking is all or nothing: the pack is extracted into a hidden directory under the snapshots
directory and verified there (every digest, the chain, the machine identity, every disk's
backing reference); only then are the directories renamed into place and registered, in one
registry transaction, root first. On any failure the hidden directory is removed, a replaced
snapshot is put back, and nothing is registered.

Host paths and URLs come from API clients: with ``roots`` every pack file read or written (and a
pull's local file or index) must lie in the packs directory, and every network URL must pass the
daemon's ``UrlPolicy``, index entries and redirects included.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.guest.protocol import AGENT_VERSION
from forkd.hostpaths import HostRoots
from forkd.packs import archive, transfer
from forkd.packs.format import MAX_CHAIN_DEPTH, META_NAME, Manifest, PackError, layer_digest
from forkd.packs.index import entry_url, load_index
from forkd.runtime.registry import Registry, SnapshotRecord
from forkd.runtime.snapshots import SnapshotConflict, SnapshotError, SnapshotService
from forkd.store.files import fsync_dir
from forkd.validation import check_tag
from forkd.vmm.base import BootSpec, MachineIdentity, SnapshotMismatch, Vmm

Progress = Callable[[str], None]
WORK_PREFIXES = (".unpack-", ".pull-", ".push-")


@dataclass
class UnpackPlan:
    """What unpacking a manifest does to the store, decided before a byte is extracted."""

    top_tag: str  # the tag the pack's top snapshot is registered as
    reuse: set[str] = field(default_factory=set)  # ancestors the store already holds with the same digest
    replaces: SnapshotRecord | None = None  # the snapshot --force replaces

    def final_tag(self, manifest: Manifest, pack_tag: str) -> str:
        return self.top_tag if pack_tag == manifest.top.tag else pack_tag


@dataclass(frozen=True)
class PullSource:
    url: str
    sha256: str | None
    size: int | None
    tag: str | None


def parent_tag(record: SnapshotRecord) -> str | None:
    return record.meta.get("parent_tag")


class PackService:
    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, snapshots: SnapshotService,
                 live_children: Callable[[str], int], roots: HostRoots | None = None,
                 urls: transfer.UrlPolicy = transfer.UrlPolicy()) -> None:
        self.paths, self.registry, self.vmm, self.snapshots = paths, registry, vmm, snapshots
        self.live_children = live_children
        self.roots = roots  # None: any host path (in-process use only; the daemon always confines)
        self.urls = urls
        self._lock = asyncio.Lock()  # one unpack at a time: two could plan against the same store
        self._reap()

    def _reap(self) -> None:
        """Remove work directories a daemon that died mid-unpack left (never registered, so unused)."""
        for entry in self.paths.snapshots.iterdir() if self.paths.snapshots.exists() else ():
            if entry.name.startswith(WORK_PREFIXES):
                shutil.rmtree(entry, ignore_errors=True)

    def pack_input(self, path: Path, what: str = "pack") -> Path:
        """A pack file (or index) an API client named, confined to the packs directory."""
        return path if self.roots is None else self.roots.pack_input(path, what)

    def pack_output(self, path: Path) -> Path:
        return path if self.roots is None else self.roots.pack_output(path)

    def _work_dir(self, prefix: str) -> Path:
        work = self.paths.snapshots / f"{prefix}{secrets.token_hex(6)}"
        work.mkdir(parents=True)
        return work

    # packing ---------------------------------------------------------------------------------------

    def chain(self, tag: str) -> list[SnapshotRecord]:
        """The snapshot ``tag`` and its ancestors, root first."""
        records: list[SnapshotRecord] = []
        current: str | None = check_tag(tag)
        while current is not None:
            record = self.registry.get_snapshot(current)
            if record is None:
                raise LookupError(f"no snapshot {current!r}" if not records else
                                  f"snapshot {records[-1].tag!r} names parent {current!r}, which is not in the store")
            if record.status != "ready":
                raise SnapshotConflict(f"snapshot {current!r} is {record.status}, not ready")
            if any(r.tag == current for r in records) or len(records) >= MAX_CHAIN_DEPTH:
                raise SnapshotError(f"the chain of {tag!r} loops or is deeper than {MAX_CHAIN_DEPTH}")
            records.append(record)
            current = parent_tag(record)
        return records[::-1]

    async def pack(self, tag: str, output: Path, force: bool, progress: Progress) -> dict[str, Any]:
        return await self._pack(tag, self.pack_output(output), force, progress)

    async def _pack(self, tag: str, output: Path, force: bool, progress: Progress) -> dict[str, Any]:
        archive.check_output(output, force)
        chain = self.chain(tag)
        progress(f"packing {' → '.join(r.tag for r in chain)}")
        started = time.monotonic()
        sources = [archive.SourceSnapshot(tag=r.tag, directory=r.path, image=r.image, created_at=r.created_at)
                   for r in chain]
        written = await asyncio.to_thread(archive.write_pack, output, sources, progress, force)
        return {"path": str(written.path), "size": written.size, "sha256": written.sha256,
                "seconds": round(time.monotonic() - started, 3), **archive.manifest_summary(written.manifest)}

    # unpacking -------------------------------------------------------------------------------------

    def check_identity(self, identity: MachineIdentity, what: str) -> None:
        """Refuse a snapshot this host cannot restore, naming every field that differs."""
        host = self.vmm.identity(BootSpec(kernel=Path(), initrd=Path(), cmdline="", memory_mib=identity.memory_mib,
                                          vcpus=identity.vcpus, kernel_sha256=identity.kernel_sha256,
                                          agent_version=identity.agent_version))
        differences = identity.differences(host)
        if identity.agent_version != AGENT_VERSION:
            differences.append(f"agent_version: saved {identity.agent_version!r}, this forkd speaks {AGENT_VERSION!r}")
        if differences:
            raise SnapshotMismatch(f"{what} was saved on a different machine and cannot be restored here: "
                                   + "; ".join(differences))

    def check_target(self, tag: str, force: bool) -> SnapshotRecord | None:
        """Refuse a taken tag unless ``force``; returns the snapshot ``force`` would replace."""
        existing = self.registry.get_snapshot(check_tag(tag))
        if existing is None:
            return None
        if not force:
            raise SnapshotConflict(f"snapshot {tag!r} exists; unpack with --tag NEW, or --force to replace it")
        live = self.live_children(tag)
        if live:
            raise SnapshotConflict(f"snapshot {tag!r} has {live} live sandboxes; kill them before replacing it")
        dependents = [r.tag for r in self.registry.list_snapshots() if parent_tag(r) == tag]
        if dependents:
            raise SnapshotConflict(f"snapshot {tag!r} is the parent of {', '.join(dependents)}; "
                                   "it cannot be replaced under them")
        return existing

    def plan(self, manifest: Manifest, tag: str | None, force: bool) -> UnpackPlan:
        """Check a manifest against this host and store; raises before anything is extracted."""
        self.check_identity(manifest.machine_identity(), f"pack of {manifest.top.tag!r}")
        plan = UnpackPlan(top_tag=check_tag(tag or manifest.top.tag))
        ancestors = manifest.snapshots[:-1]
        if plan.top_tag in {a.tag for a in ancestors}:
            raise PackError(f"tag {plan.top_tag!r} is an ancestor in this pack's chain; pick another --tag")
        root = manifest.snapshots[0]
        if root.parent_tag is not None:
            parent = self.registry.get_snapshot(root.parent_tag)
            if parent is None:
                raise PackError(f"snapshot {root.tag!r} needs parent {root.parent_tag!r}, which is neither in the pack "
                                "nor in the store: pull or unpack the parent first")
            if layer_digest(parent.meta["sha256"]) != root.parent_digest:
                raise PackError(f"snapshot {root.tag!r} was made on another {root.parent_tag!r} than the store holds "
                                "(parent digest differs)")
        for ancestor in ancestors:
            existing = self.registry.get_snapshot(ancestor.tag)
            if existing is None:
                continue
            if layer_digest(existing.meta["sha256"]) != ancestor.digest:
                raise SnapshotConflict(f"the pack's ancestor {ancestor.tag!r} differs from the store's snapshot of that "
                                       f"tag; remove the store's with `forkd rmi {ancestor.tag}` to unpack this chain")
            plan.reuse.add(ancestor.tag)
        plan.replaces = self.check_target(plan.top_tag, force)
        return plan

    def inspect(self, source: Path) -> Manifest:
        return self._manifest(self.pack_input(source))

    def _manifest(self, source: Path) -> Manifest:
        transfer.check_regular_file(source)
        try:
            return archive.read_manifest(source)
        except OSError as exc:
            raise PackError(f"cannot read pack {source}: {exc.strerror or exc}") from None

    async def unpack(self, source: Path, tag: str | None, force: bool, progress: Progress) -> dict[str, Any]:
        return await self._unpack_file(self.pack_input(source), tag, force, progress)

    async def _unpack_file(self, source: Path, tag: str | None, force: bool, progress: Progress) -> dict[str, Any]:
        manifest = await asyncio.to_thread(self._manifest, source)
        wanted = [tag or manifest.top.tag, *(s.tag for s in manifest.snapshots[:-1])]
        async with self._lock:
            with self.snapshots.reserving([check_tag(t) for t in wanted]):
                return await asyncio.to_thread(self._unpack, source, tag, force, progress)

    def _unpack(self, source: Path, tag: str | None, force: bool, progress: Progress) -> dict[str, Any]:
        started = time.monotonic()
        work = self._work_dir(".unpack-")
        decided: list[UnpackPlan] = []

        def plan_for(manifest: Manifest) -> archive.Plan:
            plan = self.plan(manifest, tag, force)
            decided.append(plan)
            targets = {s.tag: (self.paths.snapshots / s.tag if s.tag in plan.reuse
                               else work / plan.final_tag(manifest, s.tag)) for s in manifest.snapshots}
            store_files = {}
            root = manifest.snapshots[0]
            if root.parent_tag is not None:
                store_files = {r.tag: {META_NAME, *r.meta["sha256"]} for r in self.chain(root.parent_tag)}
            progress(f"unpacking {' → '.join(s.tag for s in manifest.snapshots)} as {plan.top_tag!r}"
                     + (f" (reusing {', '.join(sorted(plan.reuse))} from the store)" if plan.reuse else ""))
            return archive.Plan(targets=targets, reuse=plan.reuse, store_files=store_files)

        try:
            manifest, metas = archive.extract_pack(source, plan_for, progress)
            records = self._publish(manifest, decided[0], metas, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        top = records[-1]  # the top snapshot is never reused, so always published
        return {**top.to_dict(), "unpacked": [r.tag for r in records], "reused": sorted(decided[0].reuse),
                "seconds": round(time.monotonic() - started, 3)}

    def _publish(self, manifest: Manifest, plan: UnpackPlan, metas: dict[str, dict[str, Any]],
                 work: Path) -> list[SnapshotRecord]:
        """Rename the verified directories into place and register them root first, or undo it all."""
        moved: list[Path] = []
        set_aside: Path | None = None
        records: list[SnapshotRecord] = []
        try:
            if plan.replaces is not None:
                set_aside = work / ".replaced"
                os.rename(plan.replaces.path, set_aside)
            for entry in manifest.snapshots:
                if entry.tag in plan.reuse:
                    continue
                final_tag = plan.final_tag(manifest, entry.tag)
                final = self.paths.snapshots / final_tag
                if final.exists():
                    shutil.rmtree(final)  # left by a crash before registration: never registered, so unused
                os.rename(work / final_tag, final)
                moved.append(final)
                records.append(SnapshotRecord(tag=final_tag, status="ready", image=entry.image, path=final,
                                              created_at=time.time(), meta=metas[entry.tag]))
            fsync_dir(self.paths.snapshots)
            self.registry.replace_snapshots(records, remove=(plan.top_tag,) if plan.replaces else ())
        except BaseException:
            for directory in moved:
                shutil.rmtree(directory, ignore_errors=True)
            if set_aside is not None and plan.replaces is not None:
                os.rename(set_aside, plan.replaces.path)
            raise
        for record in records:  # the digests were just verified: the first fork need not hash again
            for name, digest in record.meta["sha256"].items():
                self.snapshots.digests.remember(record.path / name, digest)
        return records

    # pull and push ---------------------------------------------------------------------------------

    async def resolve(self, url: str | None, index: str | None, name: str | None, sha256: str | None,
                      tag: str | None) -> PullSource:
        """Where to download from; with an index, refuses a pack for another machine before downloading."""
        if index is None:
            if url is None:
                raise PackError("give a pack URL, or --index and a pack name")
            return PullSource(url=self._source(url), sha256=sha256, size=None, tag=tag)
        if name is None:
            raise PackError("give the name of a pack in the index")
        listed, base = await load_index(self._source(index, "index"), self.urls)
        entry = listed.find(name)
        self.check_identity(MachineIdentity.from_dict(entry.identity), f"pack {name!r}")
        return PullSource(url=self._source(entry_url(entry, base)), sha256=entry.sha256, size=entry.size,
                          tag=tag or entry.tag)

    def _source(self, url: str, what: str = "pack") -> str:
        """A pull source as given, if it is an allowed http(s) URL or a file in the packs directory."""
        local = transfer.local_path(url)
        if local is None:
            return self.urls.check(url)
        checked = self.pack_input(local, what)
        return url if checked == local else checked.as_uri()

    async def pull(self, source: PullSource, force: bool, progress: Progress) -> dict[str, Any]:
        if source.tag is not None:
            self.check_target(source.tag, force)  # before a long download, not after it
        local = transfer.local_path(source.url)
        if local is not None:
            local = self.pack_input(local)
        work = self._work_dir(".pull-")
        try:
            if source.sha256 is None:
                progress("no SHA-256 was advertised: only the pack's own manifest digests protect this download")
            if local is not None:
                progress(f"checking {local}")
                digest = await asyncio.to_thread(transfer.check_advertised, local, source.sha256, source.size, progress)
                pack = local
            else:
                progress(f"downloading {transfer.shown(source.url)}")
                pack = work / "pack.tar.zst"
                digest = await transfer.download(source.url, pack, source.sha256, source.size, progress, self.urls)
            progress(f"pack SHA-256 {digest}" + (" matches the advertised digest" if source.sha256 else ""))
            result = await self._unpack_file(pack, source.tag, force, progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return {**result, "pack_sha256": digest}

    def check_push_url(self, url: str) -> None:
        if transfer.local_path(url) is not None:
            raise PackError("push uploads to an http(s) URL (e.g. a presigned PUT URL); use `forkd pack` for files")
        self.urls.check(url)

    async def push(self, tag: str, url: str, progress: Progress) -> dict[str, Any]:
        self.check_push_url(url)
        work = self._work_dir(".push-")
        try:
            packed = await self._pack(tag, work / f"{tag}.tar.zst", False, progress)
            progress(f"uploading {packed['size'] / 2**20:.1f} MiB to {transfer.shown(url)}")
            await transfer.upload(Path(packed["path"]), url, progress, self.urls)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return {**packed, "path": None, "url": transfer.shown(url)}
