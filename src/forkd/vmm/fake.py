"""A VMM backend without virtual machines, so runtime logic (fork, BRANCH, workspaces, recovery) is
unit-tested in milliseconds against the same seam QEMU implements.

Each "VM" is a real host process (``tail -f`` on its console file, so it can be waited on, killed,
found by command line and adopted after a restart like a VMM) plus a small in-process server that
speaks the real guest protocol on the VM's agent socket. Guest RAM is a plain file per VM: a
child's is a copy of the snapshot's memory with its diff layers laid over it, and tests change it
with :meth:`FakeVmm.write_guest_memory` as a guest would. It is also the smallest complete backend,
the example a new one (Firecracker) follows: the core :class:`forkd.vmm.base.Vmm` with its
:class:`forkd.vmm.disk.DiskFormat` plus, optionally, :class:`forkd.vmm.branching.Branching`. Its
disks are one-line text files under another name than QEMU's (``disk.fake``), so code outside
``vmm/`` that names QEMU's disk fails the unit tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import secrets
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd.guest import protocol
from forkd.guest.protocol import AGENT_VERSION
from forkd.vmm.base import (
    CONSOLE_LOG,
    MACHINES,
    BootSpec,
    Capabilities,
    ChildSetup,
    MachineIdentity,
    MemoryStats,
    PAGE_SIZE,
    PageLayer,
    Q35,
    Pages,
    SavedVm,
    VmHandle,
    VmmError,
    VmProcess,
    no_stage_marks,
)
from forkd.vmm.branching import Capture
from forkd.vmm.disk import DiskFormat, UnsafeDisk, require_in_chain

PROGRAM = "tail"  # the fake VMM process: `tail -f RUN_DIR/console.log`
AGENT_SOCKET = "agent.sock"
DISK_HEADER = b"fake disk over "  # a fake disk: this, the file it lies over, a newline, what was written
RAM_KEY, DISK_KEY, BASE_KEY = "ram", "disk", "base"  # BASE_KEY: the memory file a child was restored from


@dataclass
class FakeBehaviour:
    """What the fake guests do; tests flip these to drive failure paths."""

    kernel_rng_reseeded: bool = True  # the answer to ``reseed``
    reseed_delay_s: float = 0.0  # how long the guest takes to answer ``reseed`` (a loaded host)
    fail_restore: str | None = None  # complete_restore raises VmmError with this message
    stalled: set[str] = field(default_factory=set)  # names whose "monitor" never answers: adopt times out
    exec_stderr: bytes = b""  # what every exec writes to stderr (sent as events) before it ends
    exec_exit_code: int = 0
    busy: set[str] = field(default_factory=set)  # names whose guest runs a user process (``activity``)


class FakeDisk:
    """The fake's disk format: ``disk.fake`` files whose first line names what they lie over."""

    file_name = "disk.fake"

    async def new_root(self, base: Path, disk: Path) -> None:
        _write_disk(disk, base.name, b"")

    async def new_child(self, layer: Path, disk: Path) -> None:
        _write_disk(disk, str(layer), b"")

    async def export_layer(self, frozen: Path, dest: Path, backing_name: str | None) -> None:
        backing, data = _read_disk(frozen)
        _write_disk(dest, backing if backing_name is None else backing_name, data)

    async def flatten(self, disk: Path, base_name: str) -> None:
        _write_disk(disk, base_name, b"flattened " + _read_disk(disk)[1])

    def check_packed(self, path: Path, own_files: set[str], ancestors: Mapping[str, set[str]]) -> None:
        if path.name != self.file_name:
            return
        require_in_chain(path, _read_disk(path)[0], own_files, ancestors)


def _write_disk(path: Path, backing: str, data: bytes) -> None:
    path.write_bytes(DISK_HEADER + backing.encode() + b"\n" + data)


def _read_disk(path: Path) -> tuple[str, bytes]:
    """What a fake disk lies over, and what was written to it."""
    header, _, data = path.read_bytes().partition(b"\n")
    if not header.startswith(DISK_HEADER):
        raise UnsafeDisk(f"{path.name} is not a fake disk")
    return header[len(DISK_HEADER):].decode(errors="replace"), data


class FakeVmm:
    kind = "fake"
    program = PROGRAM
    run_leftovers: tuple[str, ...] = (AGENT_SOCKET,)

    def __init__(self, behaviour: FakeBehaviour | None = None, machines: tuple[str, ...] = MACHINES) -> None:
        """``machines``: those it claims to run (all by default; fewer to try a refusal)."""
        self.behaviour = behaviour or FakeBehaviour()
        self.machines = machines
        self.disk: DiskFormat = FakeDisk()
        self.branching = FakeBranching(self)
        self.reseeds: list[str] = []  # sandbox ids whose agent answered a reseed, in order
        self.requests: list[tuple[str, str]] = []  # (VM name, op) of every request its agent answered
        self.evals: list[str] = []  # expressions the agents were asked to evaluate, in order
        self.clock_sets: list[tuple[str, int]] = []  # (VM name, time_ns) of every clock.set, in order
        self._agents: dict[str, asyncio.AbstractServer] = {}  # by run dir
        self._files: dict[str, FakeFiles] = {}  # each guest's files, by run dir (in memory, not kept by a fork)
        self._running: dict[str, asyncio.Event] = {}  # by run dir: cleared while paused, so the agent waits
        self._sessions: dict[str, set[asyncio.StreamWriter]] = {}  # by run dir: its agent's open connections

    def capabilities(self) -> Capabilities:
        return Capabilities(kind=self.kind, version="1", accelerator="none", accelerator_reason="no VM at all",
                            shared_memory_snapshots=True, vmgenid=False, background_snapshot=False,
                            branching=True, machine="fake-1", cpu_model="fake", machines=self.machines)

    def identity(self, spec: BootSpec) -> MachineIdentity:
        machine = "fake-1" if spec.machine == Q35 else f"{spec.machine}-fake1"  # machine_of reads both back
        return MachineIdentity(vmm=self.kind, vmm_version="1", machine=machine, accelerator="none",
                               cpu_model="fake", memory_mib=spec.memory_mib, vcpus=spec.vcpus,
                               kernel_sha256=spec.kernel_sha256, agent_version=spec.agent_version)

    async def _start(self, name: str, run_dir: Path, ram: Path, disk: Path) -> VmHandle:
        console = run_dir / CONSOLE_LOG
        console.touch()
        process = await asyncio.create_subprocess_exec(PROGRAM, "-f", str(console), stdin=asyncio.subprocess.DEVNULL,
                                                       stdout=asyncio.subprocess.DEVNULL, start_new_session=True)
        return VmHandle(name=name, run_dir=run_dir, process=process, agent_socket=run_dir / AGENT_SOCKET,
                        state={RAM_KEY: str(ram), DISK_KEY: str(disk)})

    async def boot(self, name: str, spec: BootSpec, run_dir: Path, base_disk: Path, memory: Path) -> VmHandle:
        with open(memory, "wb") as ram:
            ram.truncate(spec.memory_mib << 20)
        disk = run_dir / self.disk.file_name
        await self.disk.new_root(base_disk, disk)
        vm = await self._start(name, run_dir, memory, disk)
        await self._serve_agent(vm)
        return vm

    async def save(self, vm: VmHandle, state: Path) -> None:
        state.write_text(json.dumps({"saved": vm.name}))

    async def prepare_restore(self, name: str, saved: SavedVm, spec: BootSpec, run_dir: Path,
                              setup: ChildSetup = ChildSetup()) -> VmHandle:
        ram, disk = run_dir / "ram", run_dir / self.disk.file_name
        await asyncio.to_thread(_copy_sparse, saved.memory, ram)
        await self.disk.new_child(saved.disk, disk)
        vm = await self._start(name, run_dir, ram, disk)
        vm.state[BASE_KEY] = str(saved.memory)
        if setup.on_spawn is not None:
            try:
                setup.on_spawn(vm.pid)
            except Exception as exc:
                await self.kill(vm)
                raise VmmError(f"fake VMM for {name} could not be set up: {exc}") from None
        return vm

    async def complete_restore(self, vm: VmHandle, saved: SavedVm,
                               on_stage: Callable[[str], None] = no_stage_marks) -> None:
        if self.behaviour.fail_restore is not None:
            raise VmmError(self.behaviour.fail_restore)
        await asyncio.to_thread(_lay, Path(vm.state[RAM_KEY]), list(saved.layers))
        on_stage("state_loaded")
        await self._serve_agent(vm)
        on_stage("cont")

    async def pause(self, vm: VmHandle) -> None:
        self._alive(vm)
        self._gate(vm).clear()

    async def resume(self, vm: VmHandle) -> None:
        self._alive(vm)
        self._gate(vm).set()

    def paused(self, vm: VmHandle) -> bool:
        return not self._gate(vm).is_set()

    @staticmethod
    def _alive(vm: VmHandle) -> None:
        if vm.process.returncode is not None:
            raise VmmError(f"the fake VMM of {vm.name} has exited")

    def _gate(self, vm: VmHandle) -> asyncio.Event:
        gate = self._running.get(str(vm.run_dir))
        if gate is None:
            gate = self._running[str(vm.run_dir)] = asyncio.Event()
            gate.set()
        return gate

    async def adopt(self, name: str, process: VmProcess, run_dir: Path, state: dict[str, Any],
                    stopped_ok: bool = False) -> VmHandle:
        vm = VmHandle(name=name, run_dir=run_dir, process=process, agent_socket=run_dir / AGENT_SOCKET,
                      state=dict(state))
        if name in self.behaviour.stalled:
            await self.kill(vm)
            raise VmmError(f"the fake monitor of {name} did not answer; the VMM has been killed")
        if self.paused(vm) and not stopped_ok:
            raise VmmError(f"the fake VMM of {name} is paused, not running")
        if str(run_dir) not in self._agents:
            await self._serve_agent(vm)  # a VMM left by a daemon in another process (or test)
        return vm

    async def kill(self, vm: VmHandle) -> None:
        if vm.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                vm.process.kill()
            await vm.process.wait()
        await self._stop_agent(vm)

    def memory_stats(self, vm: VmHandle) -> MemoryStats:
        size = Path(vm.state[RAM_KEY]).stat().st_size >> 10
        return MemoryStats(rss_kib=size, pss_kib=size, private_dirty_kib=0)

    def write_guest_memory(self, vm: VmHandle, offset: int, data: bytes) -> None:
        """What a guest writing its RAM does to a child's (private) memory."""
        with open(vm.state[RAM_KEY], "r+b") as ram:
            ram.seek(offset)
            ram.write(data)

    # the guest agent

    async def _serve_agent(self, vm: VmHandle) -> None:
        async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._sessions.setdefault(str(vm.run_dir), set()).add(writer)
            with contextlib.suppress(ConnectionError, protocol.ProtocolError):
                while line := await reader.readline():
                    request = protocol.decode_frame(line)
                    await self._gate(vm).wait()  # a paused guest answers nothing until it runs again
                    if request.get("op") == protocol.OP_RESEED:
                        await asyncio.sleep(self.behaviour.reseed_delay_s)
                    for frame in itertools.chain(self._events(request), [self._answer(vm, request)]):
                        writer.write(protocol.encode_frame(frame))
                        await writer.drain()
            writer.close()

        vm.agent_socket.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(session, str(vm.agent_socket), limit=protocol.MAX_FRAME_BYTES + 1)
        self._agents[str(vm.run_dir)] = server
        asyncio.get_running_loop().create_task(self._stop_agent_on_exit(vm))

    def _events(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events a request gets before its answer: an exec's stderr, in chunks one frame can hold."""
        if request.get("op") == protocol.OP_EXEC:
            yield protocol.event(request.get("id"), protocol.EVENT_STARTED, {"pid": 1})  # as a real agent does
            data, chunk = self.behaviour.exec_stderr, protocol.FILE_CHUNK_BYTES
            for i in range(0, len(data), chunk):
                yield protocol.event(request.get("id"), protocol.EVENT_STDERR,
                                     {"data_b64": protocol.b64encode(data[i:i + chunk])})

    def _answer(self, vm: VmHandle, request: dict[str, Any]) -> dict[str, Any]:
        op, args, req_id = request.get("op"), request.get("args") or {}, request.get("id")
        self.requests.append((vm.name, str(op)))
        if op == protocol.OP_PING:
            return {"id": req_id, "ok": True, "result": {"agent_version": AGENT_VERSION, "sandbox_id": vm.name}}
        if op == protocol.OP_RESEED:
            self.reseeds.append(str(args.get("sandbox_id")))
            reseeded = self.behaviour.kernel_rng_reseeded
            return {"id": req_id, "ok": True, "result": {"kernel_rng": reseeded, "clock": True, "hostname": True,
                                                         "skipped": [] if reseeded else ["kernel_rng"]}}
        if op == protocol.OP_WARM:
            return {"id": req_id, "ok": True, "result": {"imported": args.get("modules", []), "seconds": 0.0}}
        if op in (protocol.OP_CONTEXTS_CREATE, protocol.OP_CONTEXTS_DELETE):
            return {"id": req_id, "ok": True, "result": {"id": args.get("id")}}
        if op == protocol.OP_EVAL:
            self.evals.append(str(args.get("expr")))
            return {"id": req_id, "ok": True, "result": {"value": "None", "value_json": None}}
        if op == protocol.OP_RUN_CODE:
            return {"id": req_id, "ok": True, "result": {"value": None, "value_json": None, "error": None}}
        if op == protocol.OP_ACTIVITY:
            processes = 1 if vm.name in self.behaviour.busy else 0
            return {"id": req_id, "ok": True, "result": {"processes": processes, "pids": [], "watches": 0}}
        if op == protocol.OP_CLOCK_SET:
            self.clock_sets.append((vm.name, int(args.get("time_ns", 0))))
            return {"id": req_id, "ok": True, "result": {"clock": True}}
        if op == protocol.OP_EXEC:
            return {"id": req_id, "ok": True, "result": {"exit_code": self.behaviour.exec_exit_code, "signal": None,
                                                         "timed_out": False,
                                                         "duration_s": 0.0}}
        if op in FakeFiles.OPS:
            files = self._files.setdefault(str(vm.run_dir), FakeFiles())
            try:
                return {"id": req_id, "ok": True, "result": files.answer(str(op), args)}
            except FileNotFoundError as exc:
                return {"id": req_id, "ok": False, "error": {"code": protocol.ERR_NOT_FOUND, "message": str(exc)}}
        return {"id": req_id, "ok": False, "error": {"code": protocol.ERR_UNKNOWN_OP,
                                                     "message": f"the fake agent does not do {op!r}"}}

    async def _stop_agent_on_exit(self, vm: VmHandle) -> None:
        await vm.process.wait()
        await self._stop_agent(vm)

    async def _stop_agent(self, vm: VmHandle) -> None:
        self._running.pop(str(vm.run_dir), None)
        self._files.pop(str(vm.run_dir), None)
        server = self._agents.pop(str(vm.run_dir), None)
        for writer in self._sessions.pop(str(vm.run_dir), set()):  # as a VMM's end closes its agent channel
            writer.close()
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), timeout=1)


class FakeFiles:
    """A fake guest's files, in memory: enough of the agent's ``files.*`` for a front's uploads and
    downloads to go all the way to a guest and back (regular files only, no directories)."""

    OPS = frozenset({protocol.OP_FILES_READ, protocol.OP_FILES_WRITE, protocol.OP_FILES_STAT})

    def __init__(self) -> None:
        self.data: dict[str, bytearray] = {}

    def answer(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        path = str(args.get("path"))
        if op == protocol.OP_FILES_WRITE:
            content = self.data.setdefault(path, bytearray())
            if args.get("truncate"):
                content.clear()
            offset, piece = int(args.get("offset", 0)), protocol.b64decode(str(args.get("data_b64", "")))
            content[offset:offset + len(piece)] = piece
            return {"size": len(content)}
        if path not in self.data:
            raise FileNotFoundError(f"no such file in the fake guest: {path}")
        content = self.data[path]
        if op == protocol.OP_FILES_STAT:
            return {"name": path.rsplit("/", 1)[-1], "path": path, "type": "file", "size": len(content),
                    "mode": 0o644, "mtime": 0.0}
        offset = int(args.get("offset", 0))
        piece = bytes(content[offset:offset + protocol.FILE_CHUNK_BYTES])
        return {"data_b64": protocol.b64encode(piece), "size": len(content),
                "eof": offset + len(piece) >= len(content)}


def _copy_sparse(source: Path, dest: Path) -> None:
    """A child's RAM: a copy of the snapshot's memory file in which its holes stay holes (a fake
    guest writes little, so a daemon on the fake forks children of a 1 GiB snapshot cheaply)."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(source, "rb") as src, os.fdopen(fd, "wb") as dst:
        size = os.fstat(src.fileno()).st_size
        dst.truncate(size)
        position = 0
        while position < size:
            try:
                start = os.lseek(src.fileno(), position, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole remains
                break
            position = os.lseek(src.fileno(), start, os.SEEK_HOLE)
            src.seek(start)
            dst.seek(start)
            while start < position:
                chunk = src.read(min(1 << 20, position - start))
                dst.write(chunk)
                start += len(chunk)


def _lay(ram: Path, layers: list[PageLayer]) -> None:
    """Diff layers' pages over a child's RAM file, base first (what QEMU's restore does in /proc/PID/mem)."""
    with open(ram, "r+b") as target:
        for layer in layers:
            with open(layer.path, "rb") as source:
                for guest_offset, position, length in layer.runs():
                    source.seek(position)
                    target.seek(guest_offset)
                    target.write(source.read(length))


class FakeBranching:
    """BRANCH for the fake: the "private pages" are the pages of the child's RAM file that differ from
    the memory file it was restored from (as a MAP_PRIVATE child's would), the disk layer a copy."""

    def __init__(self, vmm: FakeVmm) -> None:
        self.vmm = vmm
        self.captures = 0

    async def capture(self, vm: VmHandle, memory_bytes: int, state: Path,
                      live: bool, mark: Callable[[str], None]) -> Capture:
        frozen = Path(vm.state[DISK_KEY])
        await self.vmm.pause(vm)  # as QEMU's `stop`: the guest answers nothing until `cont`
        try:
            mark("stop")
            new_top = vm.run_dir / f"disk-{secrets.token_hex(4)}.fake"
            _write_disk(new_top, str(frozen), b"")
            vm.state[DISK_KEY] = str(new_top)
            mark("disk_switched")
            state.write_text(json.dumps({"captured": vm.name}))
            mark("device_state_saved")
            pages = await asyncio.to_thread(_differing_pages, Path(vm.state[RAM_KEY]), Path(vm.state[BASE_KEY]))
            mark("pages_read")
        finally:
            await self.vmm.resume(vm)
        mark("cont")
        self.captures += 1
        return Capture(pause_s=0.0, frozen_disk=frozen, pages=pages, state_format="fake", precopied=False)


def _differing_pages(ram: Path, memory: Path) -> Pages:
    offsets, data = array("Q"), bytearray()
    with open(ram, "rb") as mine, open(memory, "rb") as base:
        offset = 0
        while page := mine.read(PAGE_SIZE):
            if page != base.read(PAGE_SIZE).ljust(len(page), b"\0"):
                offsets.append(offset)
                data += page
            offset += len(page)
    return Pages(offsets=offsets, data=memoryview(data))
