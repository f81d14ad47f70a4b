"""Baking a snapshot: boot a parent, warm it, pause it and save it; and checking one before use.

A snapshot directory is self-contained (kernel, initrd and base disk are hard-linked in), so
rebuilding an image never changes a snapshot under the children that map it. It is assembled in a
hidden directory and renamed into place only when complete, then registered.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.guest import protocol
from forkd.guest.agent import AGENT_VERSION
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
BASE_CMDLINE = "console=ttyS0 panic=-1 quiet loglevel=4 init_on_alloc=0"


class SnapshotError(RuntimeError):
    """Creating or using a snapshot failed; the message says what to do."""


class SnapshotConflict(SnapshotError):
    """The tag is taken, or the snapshot is in use."""


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

    async def create(self, request: SnapshotRequest, image: Image, progress: Progress) -> SnapshotRecord:
        tag = check_tag(request.tag)
        if self.registry.get_snapshot(tag) is not None or tag in self._creating:
            raise SnapshotConflict(f"snapshot {tag!r} exists; remove it with `forkd rmi {tag}` or pick another tag")
        self._creating.add(tag)
        build_dir = self.paths.snapshots / f".build-{tag}-{secrets.token_hex(4)}"
        try:
            build_dir.mkdir(parents=True)
            meta = await self._bake(request, image, build_dir, progress)
            record = SnapshotRecord(tag=tag, status="ready", image=image.name, path=self.paths.snapshots / tag,
                                    created_at=time.time(), meta=meta)
            self.publish(build_dir, record, registered=False)
            return record
        except BaseException:
            kept = self._keep_console(build_dir, tag)
            if kept is not None:
                progress(f"failed; the parent's console output is kept in {kept}")
            raise
        finally:
            self._creating.discard(tag)
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
            agent, _ = await connect_when_answering(vm.agent_socket, vm.process, BOOT_TIMEOUT_S)
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
        kept.parent.mkdir(exist_ok=True)
        shutil.copyfile(console, kept)
        return kept

    def open(self, tag: str) -> tuple[SnapshotRecord, SavedVm, BootSpec]:
        """The verified files and machine of a snapshot, ready to restore children from."""
        record = self.registry.get_snapshot(check_tag(tag))
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
