"""Baking a snapshot: boot a parent, warm it, pause it and save it; and checking one before use.

A snapshot directory is self-contained (kernel, initrd and base disk are hard-linked in), so
rebuilding an image never changes a snapshot under the children that map it. It is assembled in a
hidden directory and renamed into place only when complete, then registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.guest import protocol
from forkd.guest.protocol import AGENT_VERSION
from forkd.image.builder import Image
from forkd.runtime.agent_client import AgentClient, connect_when_answering
from forkd.runtime.chains import DISK_FILE, MEMORY_FILE, ChainBroken, ancestry, chain_memory, descendants
from forkd.runtime.registry import Registry, SnapshotRecord
from forkd.store.layers import LayerError, read_layer
from forkd.store.files import DigestCache, fsync_dir, link_or_copy, sha256_file, write_json_atomic
from forkd.validation import check_tag
from forkd.vmm.base import BootSpec, MachineIdentity, SavedVm, SnapshotMismatch, Vmm, VmHandle

Progress = Callable[[str], None]

BOOT_TIMEOUT_S = 300.0
WARMUP_TIMEOUT_S = 600.0
KERNEL_FILE, INITRD_FILE, BASE_DISK_FILE = "vmlinuz", "initrd.img", "base.ext4"
STATE_FILE, META_FILE = "state", "meta.json"
HASHED_FILES = (KERNEL_FILE, INITRD_FILE, BASE_DISK_FILE, DISK_FILE, MEMORY_FILE, STATE_FILE)
# init_on_alloc=0: the Debian kernel otherwise zeroes, and so dirties, every page it hands out,
# which turns shared copy-on-write pages into private ones in every child.
MIB = 1 << 20
SPACE_SLACK_BYTES = 64 * MIB
DISK_FULL_BELOW_BYTES = 8 * MIB  # a failure with less than this free is reported as "disk full"
BUILD_PREFIX = ".build-"  # snapshots/.build-TAG-*: assembled here, renamed into place when complete
BASE_CMDLINE = "console=ttyS0 panic=-1 quiet loglevel=4 init_on_alloc=0"


class SnapshotError(RuntimeError):
    """Creating or using a snapshot failed; the message says what to do."""


class SnapshotConflict(SnapshotError):
    """The tag is taken, or the snapshot is in use."""


class SnapshotDiskFull(SnapshotError):
    """The filesystem holding snapshots ran out of space; nothing was registered or left behind."""


class SnapshotCorrupt(SnapshotError):
    """A snapshot file no longer matches the digest recorded when it was saved."""


@dataclass(frozen=True)
class SnapshotRequest:
    tag: str
    image: str = "default"
    memory_mib: int = 1024
    vcpus: int = 1
    warm_modules: tuple[str, ...] = ("numpy",)
    warmup_cmd: str | None = None


def boot_spec(directory: Path, meta: dict[str, Any]) -> BootSpec:
    """The machine a snapshot's children must be started as."""
    return BootSpec(kernel=directory / KERNEL_FILE, initrd=directory / INITRD_FILE, **meta["boot"])


class SnapshotService:
    def __init__(self, paths: Paths, registry: Registry, vmm: Vmm, digests: DigestCache) -> None:
        self.paths = paths
        self.registry = registry
        self.vmm = vmm
        self.digests = digests
        self._creating: set[str] = set()
        self._parents: set[VmHandle] = set()  # parents being baked, killed if the daemon stops

    def reserve(self, tag: str) -> None:
        """Claim ``tag`` for one create; a second create of it is refused until the first ends.

        Synchronous, so an HTTP handler can claim the tag (and answer 409) before it starts streaming.
        """
        tag = check_tag(tag)
        if self.registry.get_snapshot(tag) is not None:
            raise SnapshotConflict(f"snapshot {tag!r} exists; remove it with `forkd rmi {tag}` or pick another tag")
        if tag in self._creating:
            raise SnapshotConflict(f"snapshot {tag!r} is being created by another request; wait for it or pick "
                                   "another tag")
        self._creating.add(tag)

    def release_reservation(self, tag: str) -> None:
        self._creating.discard(tag)

    async def create(self, request: SnapshotRequest, image: Image, progress: Progress,
                     reserved: bool = False) -> SnapshotRecord:
        """Bake, publish (rename) and register ``request.tag``; ``reserved`` if the caller already claimed it."""
        tag = check_tag(request.tag)
        if not reserved:
            self.reserve(tag)
        build_dir = self.paths.snapshots / f"{BUILD_PREFIX}{tag}-{secrets.token_hex(4)}"
        try:
            self.paths.snapshots.mkdir(parents=True, exist_ok=True)
            check_free_space(self.paths.snapshots, _space_needed(request, image, self.paths.snapshots))
            build_dir.mkdir()
            meta = await self._bake(request, image, build_dir, progress)
            record = SnapshotRecord(tag=tag, status="ready", image=image.name, path=self.paths.snapshots / tag,
                                    created_at=time.time(), meta=meta)
            self.publish(build_dir, record, registered=False)
            return record
        except BaseException as exc:
            kept = self._keep_console(build_dir, tag)
            if kept is not None:
                progress(f"failed; the parent's console output is kept in {kept}")
            full = disk_full_error(exc, self.paths.snapshots, tag)
            if full is not None:
                raise full from exc
            raise
        finally:
            self.release_reservation(tag)
            shutil.rmtree(build_dir, ignore_errors=True)

    async def _bake(self, request: SnapshotRequest, image: Image, build_dir: Path, progress: Progress) -> dict[str, Any]:
        for src, name in ((image.kernel, KERNEL_FILE), (image.initrd, INITRD_FILE), (image.rootfs, BASE_DISK_FILE)):
            link_or_copy(src, build_dir / name)
        spec = BootSpec(
            kernel=build_dir / KERNEL_FILE, initrd=build_dir / INITRD_FILE,
            cmdline=f"{BASE_CMDLINE} forkd.hostname=forkd-{request.tag}",
            memory_mib=request.memory_mib, vcpus=request.vcpus,
            kernel_sha256=image.kernel_sha256, agent_version=image.agent_version,
        )
        if image.agent_version != AGENT_VERSION:
            raise SnapshotError(f"image {image.name!r} has agent {image.agent_version}, this forkd speaks "
                                f"{AGENT_VERSION}: rebuild it with `forkd image build --force`")
        caps = self.vmm.capabilities()
        progress(f"booting parent VM ({caps.kind} {caps.version}, {caps.accelerator}: {caps.accelerator_reason})")
        started = time.monotonic()
        vm = await self.vmm.boot(f"parent-{request.tag}", spec, build_dir, build_dir / BASE_DISK_FILE,
                                 build_dir / MEMORY_FILE)
        self._parents.add(vm)
        agent: AgentClient | None = None
        try:
            agent, _ = await connect_when_answering(vm, BOOT_TIMEOUT_S)
            boot_s = time.monotonic() - started
            progress(f"guest agent answered after {boot_s:.1f} s")
            if request.warm_modules:
                warmed = await agent.call(protocol.OP_WARM, {"modules": list(request.warm_modules)},
                                          timeout=WARMUP_TIMEOUT_S)
                progress(f"imported {', '.join(warmed.get('imported', []))} in {warmed.get('seconds', 0):.1f} s")
            if request.warmup_cmd:
                progress(f"running warmup command: {request.warmup_cmd}")
                await run_warmup(agent, request.warmup_cmd)
            progress("pausing and saving device state")
            save_started = time.monotonic()
            await self.vmm.save(vm, build_dir / STATE_FILE)
            save_s = time.monotonic() - save_started
        finally:
            if agent is not None:
                await agent.close()
            await self.vmm.kill(vm)
            self._parents.discard(vm)
        for leftover in ("agent.sock", "qmp.sock"):
            (build_dir / leftover).unlink(missing_ok=True)
        progress("recording content digests")
        digests = await asyncio.to_thread(seal_files, build_dir, HASHED_FILES)
        meta = {
            "identity": asdict(self.vmm.identity(spec)),
            "boot": {"cmdline": spec.cmdline, "memory_mib": spec.memory_mib, "vcpus": spec.vcpus,
                     "kernel_sha256": spec.kernel_sha256, "agent_version": spec.agent_version},
            "image_key": image.key,
            "warm_modules": list(request.warm_modules),
            "warmup_cmd": request.warmup_cmd,
            "sha256": digests,
            "sizes": {name: (build_dir / name).stat().st_size for name in HASHED_FILES},
            "boot_seconds": round(boot_s, 3),
            "save_seconds": round(save_s, 4),
        }
        write_json_atomic(build_dir / META_FILE, meta)
        return meta

    @contextlib.contextmanager
    def reserving(self, tags: list[str]) -> Iterator[None]:
        """Hold ``tags`` as being created (by an unpack) so a concurrent ``create`` is refused, not raced."""
        busy = [t for t in tags if t in self._creating]
        if busy:
            raise SnapshotConflict(f"snapshot {busy[0]!r} is being created right now; try again when it is done")
        self._creating.update(tags)
        try:
            yield
        finally:
            self._creating.difference_update(tags)

    def publish(self, build_dir: Path, record: SnapshotRecord, registered: bool) -> None:
        """Rename a finished build dir into place, then register it ready (files first, record second)."""
        if record.path.exists():
            shutil.rmtree(record.path)  # left by a crash before it was ready: never used
        os.rename(build_dir, record.path)
        fsync_dir(self.paths.snapshots)
        record.status = "ready"
        if registered:
            self.registry.update_snapshot(record.tag, status="ready", meta=record.meta)
        else:
            self.registry.add_snapshot(record)
        # Trust the digests just computed so the first fork does not hash a gigabyte again.
        for name, digest in record.meta["sha256"].items():
            self.digests.remember(record.path / name, digest)

    async def abort_all(self) -> None:
        """Kill parents still being baked (their build directories are removed by ``create``)."""
        await asyncio.gather(*(self.vmm.kill(vm) for vm in list(self._parents)), return_exceptions=True)

    def _keep_console(self, build_dir: Path, tag: str) -> Path | None:
        console = build_dir / "console.log"
        if not console.exists():
            return None
        kept = self.paths.home / "logs" / f"snapshot-{tag}.console.log"
        try:  # best effort: on a full disk there may be no room for it
            kept.parent.mkdir(exist_ok=True)
            shutil.copyfile(console, kept)
        except OSError:
            kept.unlink(missing_ok=True)
            return None
        return kept

    def open(self, tag: str) -> tuple[SnapshotRecord, SavedVm, BootSpec]:
        """The verified files and machine of a snapshot, ready to restore children from."""
        record = self.registry.get_snapshot(check_tag(tag))
        if record is None and tag in self._creating:
            raise SnapshotConflict(f"snapshot {tag!r} is still being created; fork it when it is ready")
        if record is None:
            raise SnapshotError(f"no snapshot {tag!r}; create it with `forkd snapshot create --tag {tag}`")
        if record.status != "ready":
            raise SnapshotConflict(f"snapshot {tag!r} is {record.status}, not ready")
        try:
            chain = ancestry(self.registry, record)
        except ChainBroken as exc:
            raise SnapshotCorrupt(str(exc)) from None
        for link in chain:  # a stat per file and link: each file version is hashed once (DigestCache)
            self._verify(link)
        memory = chain_memory(chain)
        try:
            layers = tuple(read_layer(path) for path in memory.layers)
        except LayerError as exc:
            raise SnapshotCorrupt(f"snapshot {tag!r}: {exc}") from None
        spec = boot_spec(record.path, record.meta)
        saved_identity = MachineIdentity.from_dict(record.meta["identity"])
        differences = saved_identity.differences(self.vmm.identity(spec))
        if AGENT_VERSION != spec.agent_version:
            differences.append(f"agent_version: snapshot has {spec.agent_version!r}, this forkd speaks {AGENT_VERSION!r}")
        if differences:
            raise SnapshotMismatch(f"snapshot {tag!r} was saved on a different machine; " + "; ".join(differences)
                                   + f". Create it again here with `forkd snapshot create --tag {tag}`")
        saved = SavedVm(memory=memory.base, state=record.path / STATE_FILE,
                        disk=record.path / DISK_FILE, identity=saved_identity, layers=layers)
        return record, saved, spec

    def _verify(self, record: SnapshotRecord) -> None:
        """Every file of one snapshot still has the digest recorded when it was saved."""
        tag = record.tag
        for name, digest in record.meta["sha256"].items():
            path = record.path / name
            try:
                actual = self.digests.sha256(path)
            except OSError as exc:
                raise SnapshotCorrupt(f"snapshot {tag!r} is missing {name} ({exc}); remove it with `forkd rmi {tag}`") from None
            if actual != digest:
                raise SnapshotCorrupt(f"snapshot {tag!r}: {name} was modified after it was saved (SHA-256 "
                                      f"{actual[:12]}… ≠ recorded {digest[:12]}…); remove it with `forkd rmi {tag}` "
                                      "and create it again")

    def remove(self, tag: str, live_children: Callable[[str], int], cascade: bool = False,
               force: bool = False) -> list[str]:
        """Remove a snapshot; with ``cascade`` also every snapshot branched from it. Returns the tags removed.

        Without ``cascade`` or ``force`` a snapshot others were branched from is kept: removing it
        would leave them unusable. ``force`` removes it anyway (its dependents then refuse to fork).
        """
        record = self.registry.get_snapshot(check_tag(tag))
        if record is None:
            raise SnapshotError(f"no snapshot {tag!r}")
        dependents = descendants(self.registry, tag)
        if dependents and not (cascade or force):
            raise SnapshotConflict(f"snapshot {tag!r} has dependents {', '.join(sorted(dependents))}; remove them "
                                   f"too with `forkd rmi --cascade {tag}`, or orphan them with `--force`")
        doomed = [*dependents, tag] if cascade else [tag]
        busy = {t: n for t in doomed if (n := live_children(t)) or t in self._creating
                or self.registry.get_snapshot(t).status == "writing"}  # type: ignore[union-attr]
        if busy:
            raise SnapshotConflict("snapshots in use: " + ", ".join(
                f"{t!r} ({n} live sandboxes)" if n else f"{t!r} (being written)" for t, n in busy.items())
                + "; kill the sandboxes or wait, then remove again")
        for victim in doomed:
            path = self.registry.get_snapshot(victim).path  # type: ignore[union-attr]
            self.registry.remove_snapshot(victim)
            shutil.rmtree(path, ignore_errors=True)
        return doomed


def seal_files(directory: Path, names: tuple[str, ...]) -> dict[str, str]:
    """Make a snapshot's files read-only and return their SHA-256 digests."""
    result = {}
    for name in names:
        path = directory / name
        os.chmod(path, 0o400)  # children map these; nobody should write them again
        result[name] = sha256_file(path)
    return result


def _space_needed(request: SnapshotRequest, image: Image, directory: Path) -> int:
    """Bytes a build may write: all of guest RAM (the parent may touch every page), copies of image
    files that cannot be hard-linked from another filesystem, and slack for overlay, state and logs."""
    needed = request.memory_mib * MIB + SPACE_SLACK_BYTES
    device = directory.stat().st_dev
    for path in (image.kernel, image.initrd, image.rootfs):
        info = path.stat()
        if info.st_dev != device:
            needed += info.st_size
    return needed


def check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise SnapshotDiskFull(f"disk full: {free / MIB:.0f} MiB free under {directory}, a snapshot of this size "
                               f"needs up to {needed / MIB:.0f} MiB; free space (`forkd rmi` unused snapshots) or "
                               "move FORKD_HOME to a larger filesystem")


def disk_full_error(exc: BaseException, directory: Path, tag: str) -> SnapshotDiskFull | None:
    """A clear "disk full" error when ``exc`` came from running out of space, else ``None``.

    Out of space shows up in many guises: ENOSPC from a copy, a failed migration, or a parent VMM
    killed by SIGBUS when its shared RAM file could not grow. Any of them with (almost) no space
    left is reported as what it is.
    """
    if isinstance(exc, SnapshotDiskFull):
        return exc
    causes = [exc, exc.__cause__, exc.__context__]
    out_of_space = any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in causes)
    try:
        out_of_space = out_of_space or shutil.disk_usage(directory).free < DISK_FULL_BELOW_BYTES
    except OSError:
        pass
    if not out_of_space:
        return None
    return SnapshotDiskFull(f"disk full while creating snapshot {tag!r} under {directory} ({exc}); nothing was "
                            "registered and the partial snapshot was removed. Free space (`forkd rmi` unused "
                            "snapshots) or move FORKD_HOME to a larger filesystem, then create it again")


async def run_warmup(agent: AgentClient, command: str) -> None:
    """Start ``command`` in the guest and wait until it prints a ``{"ready": true}`` line."""
    ready = asyncio.get_running_loop().create_future()
    buffered = bytearray()

    def on_event(name: str, data: dict[str, Any]) -> None:
        if name != protocol.EVENT_STDOUT or ready.done():
            return
        buffered.extend(protocol.b64decode(data.get("data_b64", "")))
        *lines, rest = bytes(buffered).split(b"\n")
        buffered[:] = rest
        for line in lines:
            try:
                if json.loads(line).get("ready") is True:
                    ready.set_result(None)
                    return
            except (ValueError, AttributeError):
                continue

    command_done = asyncio.create_task(
        agent.call(protocol.OP_EXEC, {"shell": command}, timeout=None, on_event=on_event))
    done, _ = await asyncio.wait({ready, command_done}, timeout=WARMUP_TIMEOUT_S,
                                 return_when=asyncio.FIRST_COMPLETED)
    try:
        if ready in done:
            return  # the command keeps running in the guest and is part of the snapshot
        if command_done in done:
            outcome = command_done.exception() or command_done.result()
            raise SnapshotError(f'warmup command ended ({outcome}) before printing {{"ready": true}}')
        raise SnapshotError(f'warmup command did not print {{"ready": true}} within {WARMUP_TIMEOUT_S:.0f} s')
    finally:
        command_done.cancel()  # stops waiting on the host side only; the guest process lives on
