"""Baking a snapshot: boot a parent, warm it, pause it and save it into the store.

A snapshot directory is self-contained (kernel, initrd and base disk are hard-linked in), so
rebuilding an image never changes a snapshot under the children that map it. Where it is built,
how it is published and registered, and how it is opened for a fork is the store's
(:class:`forkd.store.snapshots.SnapshotStore`).
"""

from __future__ import annotations

import asyncio
import errno
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from forkd.config import Paths
from forkd.guest import protocol
from forkd.guest.protocol import AGENT_VERSION
from forkd.image.builder import Image
from forkd.runtime.agent_client import AgentClient, connect_when_answering
from forkd.store.errors import DiskFull, SnapshotDiskFull, SnapshotError
from forkd.store.space import SpaceFloor
from forkd.store.files import link_or_copy
from forkd.store.io import blocking, remove_tree
from forkd.store.layout import BASE_DISK_FILE, INITRD_FILE, KERNEL_FILE, MEMORY_FILE, STATE_FILE, baked_files
from forkd.store.registry import SnapshotRecord
from forkd.store.snapshots import Claim, SnapshotStore
from forkd.vmm.base import Q35, BootSpec, Vmm, VmHandle

Progress = Callable[[str], None]

BOOT_TIMEOUT_S = 300.0
WARMUP_TIMEOUT_S = 600.0
READY_LINE_BYTES = 64 << 10  # a warmup command's output line the host holds while looking for its ready line
MIB = 1 << 20
SPACE_SLACK_BYTES = 64 * MIB
DISK_FULL_BELOW_BYTES = 8 * MIB  # a failure with less than this free is reported as "disk full"
# init_on_alloc=0: the Debian kernel otherwise zeroes, and so dirties, every page it hands out,
# which turns shared copy-on-write pages into private ones in every child.
# The rest keeps an idle guest from waking its emulated CPU (each wake costs its VMM CPU under TCG;
# measured with a guest ftrace, docs/operations.md "Idle children are stopped"): no lockup
# watchdogs, no clocksource watchdog (QEMU's TSC is the host's clock: tsc=reliable), no
# transparent huge pages (khugepaged's scans, and a huge page zeroed in a child is 2 MiB of its
# memory copied on write), no proactive compaction (kcompactd every 500 ms).
BASE_CMDLINE = ("console=ttyS0 panic=-1 quiet loglevel=4 init_on_alloc=0 nowatchdog nmi_watchdog=0 tsc=reliable "
                "transparent_hugepage=never sysctl.vm.compaction_proactiveness=0")


@dataclass(frozen=True)
class SnapshotRequest:
    tag: str
    image: str = "default"
    memory_mib: int = 1024
    vcpus: int = 1
    warm_modules: tuple[str, ...] = ("numpy",)
    warm_code: str | None = None  # Python run once in the warm template after the imports
    warmup_cmd: str | None = None
    machine: str | None = None  # MACHINES; None: the daemon's default (`vmm_machine`)


class SnapshotService:
    def __init__(self, paths: Paths, store: SnapshotStore, vmm: Vmm, space: SpaceFloor,
                 default_machine: str = Q35) -> None:
        self.paths = paths
        self.default_machine = default_machine
        self.space = space
        self.store = store
        self.vmm = vmm
        self._parents: set[VmHandle] = set()  # parents being baked, killed if the daemon stops

    def parents(self) -> list[VmHandle]:
        """The parents being baked now (their consoles are bounded like a sandbox's, runtime/keepers.py)."""
        return list(self._parents)

    def resolve(self, request: SnapshotRequest) -> SnapshotRequest:
        """``request`` with its machine type chosen, refused (before any tag is claimed or VM booted)
        when the backend cannot run it: its children would fail at their first fork otherwise."""
        machine = request.machine or self.default_machine
        offered = self.vmm.capabilities().machines
        if machine not in offered:
            raise SnapshotError(f"the {self.vmm.capabilities().kind} backend cannot run machine type {machine!r} "
                                f"(it runs {', '.join(offered)}): create the snapshot with `--machine {offered[0]}`")
        return replace(request, machine=machine)

    def claim(self, tag: str) -> Claim:
        """Claim ``tag`` for one create (409 if taken or claimed); synchronous, so a handler answers 409 first."""
        return self.store.claim(tag, "created")

    async def create(self, request: SnapshotRequest, image: Image, progress: Progress,
                     claim: Claim | None = None) -> SnapshotRecord:
        """Bake ``request.tag`` and publish it through the store; ``claim`` if the caller already holds the tag."""
        try:
            request = self.resolve(request)
        except SnapshotError:
            if claim is not None:
                claim.release()
            raise
        with claim or self.claim(request.tag) as held:
            tag = held.tags[0]
            build_dir = self.store.build_dir(tag)
            try:
                await blocking(self.space.check, self.paths.snapshots,
                               _space_needed(request, image, self.paths.snapshots), f"a snapshot {tag!r} of this size")
                meta = await self._bake(request, image, build_dir, progress)
                record = SnapshotRecord(tag=tag, status="ready", image=image.name, path=self.paths.snapshots / tag,
                                        created_at=time.time(), meta=meta)
                await blocking(self.store.publish, held, [(build_dir, record)])
                return record
            except BaseException as exc:
                kept = await blocking(self._keep_console, build_dir, tag)
                if kept is not None:
                    progress(f"failed; the parent's console output is kept in {kept}")
                full = disk_full_error(exc, self.paths.snapshots, tag)
                if full is not None:
                    raise full from exc
                raise
            finally:
                await remove_tree(build_dir)

    async def _bake(self, request: SnapshotRequest, image: Image, build_dir: Path, progress: Progress) -> dict[str, Any]:
        for src, name in ((image.kernel, KERNEL_FILE), (image.initrd, INITRD_FILE), (image.rootfs, BASE_DISK_FILE)):
            await blocking(link_or_copy, src, build_dir / name)  # a copy when the image is on another filesystem
        spec = BootSpec(
            kernel=build_dir / KERNEL_FILE, initrd=build_dir / INITRD_FILE,
            cmdline=f"{BASE_CMDLINE} forkd.hostname=forkd-{request.tag}",
            memory_mib=request.memory_mib, vcpus=request.vcpus,
            kernel_sha256=image.kernel_sha256, agent_version=image.agent_version, machine=request.machine or Q35,
        )
        if image.agent_version != AGENT_VERSION:
            raise SnapshotError(f"image {image.name!r} has agent {image.agent_version}, this forkd speaks "
                                f"{AGENT_VERSION}: rebuild it with `forkd image build --force`")
        caps = self.vmm.capabilities()  # resolved off the loop when the runtime started
        progress(f"booting parent VM ({caps.kind} {caps.version}, {spec.machine}, {caps.accelerator}: "
                 f"{caps.accelerator_reason})")
        started = time.monotonic()
        vm = await self.vmm.boot(f"parent-{request.tag}", spec, build_dir, build_dir / BASE_DISK_FILE,
                                 build_dir / MEMORY_FILE)
        self._parents.add(vm)
        agent: AgentClient | None = None
        try:
            agent, _ = await connect_when_answering(vm, BOOT_TIMEOUT_S)
            boot_s = time.monotonic() - started
            progress(f"guest agent answered after {boot_s:.1f} s")
            if request.warm_modules or request.warm_code:
                warmed = await agent.call(protocol.OP_WARM,
                                          {"modules": list(request.warm_modules), "code": request.warm_code},
                                          timeout=WARMUP_TIMEOUT_S)
                what = ", ".join(warmed.get("imported", [])) or "nothing"
                ran = " and ran the warm code" if request.warm_code else ""
                progress(f"imported {what}{ran} in {warmed.get('seconds', 0):.1f} s")
            if request.warmup_cmd:
                progress(f"running warmup command: {request.warmup_cmd}")
                await run_warmup(agent, request.warmup_cmd)
            if request.warm_modules or request.warm_code:
                # The default context forked from the warm template now, so the snapshot holds it: a
                # child's first cell runs at once instead of first forking a whole warm interpreter
                # (200-400 ms under TCG). Created without running a cell in it, so each child's reseed
                # sends its seed with its first cell instead of waking it (guest/interpreters.py).
                await agent.call(protocol.OP_CONTEXTS_CREATE, {"id": protocol.DEFAULT_CONTEXT},
                                 timeout=WARMUP_TIMEOUT_S)
            progress("pausing and saving device state")
            save_started = time.monotonic()
            await self.vmm.save(vm, build_dir / STATE_FILE)
            save_s = time.monotonic() - save_started
        finally:
            if agent is not None:
                await agent.close()
            await self.vmm.kill(vm)
            self._parents.discard(vm)
        for leftover in self.vmm.run_leftovers:  # the build directory was the parent's run directory
            (build_dir / leftover).unlink(missing_ok=True)
        progress("recording content digests")
        files = baked_files(self.vmm.disk.file_name)
        digests = await blocking(self.store.seal, build_dir, files)
        meta = {
            "identity": asdict(self.vmm.identity(spec)),
            "boot": {"cmdline": spec.cmdline, "memory_mib": spec.memory_mib, "vcpus": spec.vcpus,
                     "kernel_sha256": spec.kernel_sha256, "agent_version": spec.agent_version,
                     "machine": spec.machine},
            "image_key": image.key,
            "warm_modules": list(request.warm_modules),
            "warm_code": request.warm_code,
            "warmup_cmd": request.warmup_cmd,
            "sha256": digests,
            "sizes": {name: (build_dir / name).stat().st_size for name in files},
            "boot_seconds": round(boot_s, 3),
            "save_seconds": round(save_s, 4),
        }
        return self.store.write_meta(build_dir, meta)

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


def disk_full_error(exc: BaseException, directory: Path, tag: str) -> DiskFull | None:
    """A clear "disk full" error when ``exc`` came from running out of space, else ``None``.

    Out of space shows up in many guises: ENOSPC from a copy, a failed migration, or a parent VMM
    killed by SIGBUS when its shared RAM file could not grow. Any of them with (almost) no space
    left is reported as what it is.
    """
    if isinstance(exc, DiskFull):
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


class ReadyLine:
    """Finds a ``{"ready": true}`` line in a warmup command's stdout, holding at most one bounded line.

    The command's output is the guest's: a line is only kept up to ``READY_LINE_BYTES`` (a longer
    one cannot be the ready line and is skipped whole), and each chunk is scanned once, so a command
    that writes without a newline costs neither memory nor quadratic copying.
    """

    def __init__(self) -> None:
        self.held = bytearray()  # the line so far, at most READY_LINE_BYTES
        self._overlong = False  # the current line went past the bound: skip it to its newline

    def feed(self, chunk: bytes) -> bool:
        """True once a complete ready line has been seen."""
        *ended, rest = chunk.split(b"\n")
        for piece in ended:
            overlong = self._overlong or len(self.held) + len(piece) > READY_LINE_BYTES
            line = b"" if overlong else bytes(self.held) + piece
            self.held.clear()
            self._overlong = False
            if not overlong and _is_ready(line):
                return True
        if not self._overlong:
            self.held.extend(rest[:READY_LINE_BYTES + 1 - len(self.held)])
            if len(self.held) > READY_LINE_BYTES:
                self.held.clear()
                self._overlong = True
        return False


def _is_ready(line: bytes) -> bool:
    try:
        parsed = json.loads(line)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("ready") is True


async def run_warmup(agent: AgentClient, command: str) -> None:
    """Start ``command`` in the guest and wait until it prints a ``{"ready": true}`` line."""
    ready = asyncio.get_running_loop().create_future()
    lines = ReadyLine()

    def on_event(name: str, data: dict[str, Any]) -> None:
        if name == protocol.EVENT_STDOUT and not ready.done() and lines.feed(protocol.b64decode(data.get("data_b64", ""))):
            ready.set_result(None)

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
