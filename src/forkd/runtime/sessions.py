"""Sessions: running things inside a live sandbox — commands, Python cells, files and processes.

The one place guest-protocol calls become typed results and events. The daemon's routes use it, and
so does every other front end that talks to sandboxes (the E2B front, MCP through the daemon): plain
``async`` methods for calls that answer once, an :class:`Execution` (an async iterator of typed
events, then a result) for commands and cells whose output streams.

The streaming machinery (bounds, flow control, cancelling in the guest) is ``runtime/execution.py``;
the specs, events and results are ``runtime/results.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentUnavailable
from forkd.runtime.execution import Execution, Explain
from forkd.runtime.options import OutputLimits
from forkd.runtime.results import (
    CellSpec,
    CodeResult,
    CommandResult,
    CommandSpec,
    FileDownload,
    Output,
    read_code_result,
    read_command_result,
)
from forkd.runtime.sandboxes import SandboxEnded
from forkd.runtime.spool import Spool, SpoolBudget
from forkd.store.space import SpaceFloor

MAX_TIMEOUT_S = 24 * 3600  # longest a command, cell or eval may be given
CALL_GRACE_S = 30.0  # the host waits this much longer than the guest's own timeout
WRITE_CHUNK_BYTES = protocol.FILE_CHUNK_BYTES  # one files.write call
# For one chunk to be written once the guest has read it: minutes, since a TCG guest on a loaded host
# is starved for that long (an agent that dies closes its connection and fails the write at once).
WRITE_CHUNK_TIMEOUT_S = 300.0
T = TypeVar("T")


class _Record(Protocol):
    meta: dict[str, Any]


class _Running(Protocol):
    agent: AgentClient
    record: _Record


class SandboxLookup(Protocol):
    """What sessions need of the sandbox service: a running sandbox (its agent, its default envs), and
    whether one ended (so a call cut by the sandbox's end says so rather than "agent unavailable")."""

    def get(self, sandbox_id: str) -> _Running: ...

    async def ended(self, sandbox_id: str, within_s: float = 5.0) -> bool: ...


def _call_timeout(timeout_s: float | None) -> float:
    return (timeout_s or MAX_TIMEOUT_S) + CALL_GRACE_S


class Sessions:
    def __init__(self, sandboxes: SandboxLookup, limits: OutputLimits | None = None,
                 spool_dir: Path | None = None, space: SpaceFloor | None = None,
                 spool_budget: SpoolBudget | None = None) -> None:
        self.sandboxes = sandboxes
        self.limits = limits or OutputLimits()
        self.spool_dir = spool_dir  # where uploads wait for their guest (None: the system's temp dir)
        self.space = space  # the free space uploads leave under spool_dir (None: no floor)
        self.spool_budget = spool_budget or SpoolBudget()  # what all uploads together may spool

    def _agent(self, sandbox_id: str) -> AgentClient:
        return self.sandboxes.get(sandbox_id).agent

    def _explainer(self, sandbox_id: str) -> Explain:
        async def explain(exc: AgentUnavailable) -> Exception:
            if await self.sandboxes.ended(sandbox_id):
                return SandboxEnded(f"sandbox {sandbox_id} ended while the call ran (its timeout, or a kill); "
                                    f"start a new one: {exc.message}")
            return exc
        return explain

    async def _guarded(self, sandbox_id: str, work: Awaitable[T]) -> T:
        """``work``, with an agent connection cut by the sandbox's end reported as :class:`SandboxEnded`."""
        try:
            return await work
        except AgentUnavailable as exc:
            raise await self._explainer(sandbox_id)(exc) from None

    def _execution(self, sandbox_id: str, op: str, args: dict[str, Any], timeout_s: float | None,
                   output_limit: int | None, raw: bool = False, notices: bool = True) -> Execution:
        return Execution(self._agent(sandbox_id), op, args, _call_timeout(timeout_s), output_limit,
                         self.limits.stream_buffer_bytes, self._explainer(sandbox_id), raw, notices)

    # -- commands and cells

    def _exec_args(self, sandbox_id: str, spec: CommandSpec) -> dict[str, Any]:
        envs = self.sandboxes.get(sandbox_id).record.meta.get("envs") or {}
        args: dict[str, Any] = {"env": {**envs, **spec.env}}
        if spec.cmd is not None:
            args["shell"] = spec.cmd
        else:
            args["argv"] = spec.argv
        for key in ("cwd", "timeout_s", "user"):
            if getattr(spec, key) is not None:
                args[key] = getattr(spec, key)
        if spec.warm:
            args["warm"] = True
        if spec.stdin is not None:
            args["stdin_b64"] = protocol.b64encode(spec.stdin)
        return args

    async def start_exec(self, sandbox_id: str, spec: CommandSpec, raw: bool = False) -> Execution:
        """Start a command and return it running: iterate its events, then ``command_result``.

        ``raw``: its output comes as :class:`Data` (bytes) instead of :class:`Output` (text).
        """
        execution = self._execution(sandbox_id, protocol.OP_EXEC, self._exec_args(sandbox_id, spec), spec.timeout_s,
                                    self.limits.stream_bytes, raw)
        return await self._guarded(sandbox_id, execution.start())

    async def start_pty(self, sandbox_id: str, spec: CommandSpec, rows: int = 24, cols: int = 80) -> Execution:
        """Start an argv command on a pseudo-terminal; what it writes comes as ``Data("pty", ...)`` events.

        The terminal's program is steered by pid with :meth:`pty_input`, :meth:`pty_resize` and
        :meth:`pty_signal`. It has no deadline; like a command it is paused when its reader falls
        behind, and cancelling it hangs the session up (SIGHUP, then SIGKILL; agents before this
        one ignore both: end such a terminal with :meth:`pty_signal`).
        """
        if spec.argv is None:
            raise ValueError("a PTY runs an argv command, not a shell string")
        envs = self.sandboxes.get(sandbox_id).record.meta.get("envs") or {}
        args: dict[str, Any] = {"argv": spec.argv, "env": {**envs, **spec.env}, "rows": rows, "cols": cols}
        if spec.cwd is not None:
            args["cwd"] = spec.cwd
        execution = self._execution(sandbox_id, protocol.OP_PTY_START, args, None, self.limits.stream_bytes, raw=True)
        return await self._guarded(sandbox_id, execution.start())

    async def start_cell(self, sandbox_id: str, spec: CellSpec) -> Execution:
        """Start a Python cell in a context and return it running."""
        execution = self._execution(sandbox_id, protocol.OP_RUN_CODE, self._cell_args(spec), spec.timeout_s,
                                    self.limits.stream_bytes)
        return await self._guarded(sandbox_id, execution.start())

    @staticmethod
    def _cell_args(spec: CellSpec) -> dict[str, Any]:
        args: dict[str, Any] = {"code": spec.code, "context": spec.context}
        if spec.timeout_s is not None:
            args["timeout_s"] = spec.timeout_s
        return args

    async def exec(self, sandbox_id: str, spec: CommandSpec) -> CommandResult:
        """Run a command to its end; its output (up to the result budget) comes back in the result."""
        execution = self._execution(sandbox_id, protocol.OP_EXEC, self._exec_args(sandbox_id, spec), spec.timeout_s,
                                    self.limits.result_bytes, notices=False)
        raw, stdout, stderr = await self._guarded(sandbox_id, self._collect(execution))
        return read_command_result(raw, stdout, stderr, execution.truncated)

    async def run_code(self, sandbox_id: str, spec: CellSpec) -> CodeResult:
        """Run a cell to its end; what it printed (up to the result budget) comes back in the result."""
        # Its rich results come back in the agent's answer: their events are not held (nor counted) here.
        execution = self._execution(sandbox_id, protocol.OP_RUN_CODE, self._cell_args(spec), spec.timeout_s,
                                    self.limits.result_bytes, notices=False)
        raw, stdout, stderr = await self._guarded(sandbox_id, self._collect(execution))
        return read_code_result(raw, stdout, stderr, execution.truncated)

    @staticmethod
    async def _collect(execution: Execution) -> tuple[dict[str, Any], str, str]:
        await execution.start()
        printed: dict[str, list[str]] = {protocol.EVENT_STDOUT: [], protocol.EVENT_STDERR: []}
        async for event in execution:
            if isinstance(event, Output):
                printed[event.stream].append(event.text)
        raw = await execution.raw_result()
        for tail in execution.flush():
            printed[tail.stream].append(tail.text)
        return raw, "".join(printed[protocol.EVENT_STDOUT]), "".join(printed[protocol.EVENT_STDERR])

    @staticmethod
    def command_result(execution: Execution, raw: dict[str, Any]) -> CommandResult:
        """The result of a streamed command (its output went out as events)."""
        return read_command_result(raw, "", "", execution.truncated)

    @staticmethod
    def cell_result(execution: Execution, raw: dict[str, Any]) -> CodeResult:
        return read_code_result(raw, "", "", execution.truncated)

    async def eval(self, sandbox_id: str, expr: str, context: str = "default",
                   timeout_s: float = 60.0) -> dict[str, Any]:
        """``{value, value_json, type, error}`` of one expression in a context."""
        # The guest ends the expression at ``timeout_s`` and answers a timeout; the host waits a grace longer.
        return await self._call(sandbox_id, protocol.OP_EVAL, {"expr": expr, "context": context, "timeout_s": timeout_s},
                                _call_timeout(timeout_s))

    async def ping(self, sandbox_id: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_PING, {}, 10.0)

    # -- processes started by exec

    async def processes(self, sandbox_id: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_PROC_LIST, {})

    async def signal(self, sandbox_id: str, pid: int, signum: int) -> None:
        await self._call(sandbox_id, protocol.OP_PROC_KILL, {"pid": pid, "signal": signum})

    async def write_stdin(self, sandbox_id: str, pid: int, data: bytes, eof: bool = False) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_PROC_STDIN,
                                {"pid": pid, "data_b64": protocol.b64encode(data), "eof": eof})

    # -- terminals started by start_pty

    async def pty_input(self, sandbox_id: str, pid: int, data: bytes) -> None:
        await self._call(sandbox_id, protocol.OP_PTY_INPUT, {"pid": pid, "data_b64": protocol.b64encode(data)})

    async def pty_resize(self, sandbox_id: str, pid: int, rows: int, cols: int) -> None:
        await self._call(sandbox_id, protocol.OP_PTY_RESIZE, {"pid": pid, "rows": rows, "cols": cols})

    async def pty_signal(self, sandbox_id: str, pid: int, signum: int) -> None:
        await self._call(sandbox_id, protocol.OP_PTY_KILL, {"pid": pid, "signal": signum})

    # -- watching directories (inotify in the guest; events wait there until read)

    async def watch(self, sandbox_id: str, path: str, recursive: bool = False) -> str:
        """A new watcher's id; its events are read with :meth:`watch_events`, and it is ended with :meth:`unwatch`."""
        return str((await self._call(sandbox_id, protocol.OP_WATCH_CREATE,
                                     {"path": path, "recursive": recursive}))["id"])

    async def watch_events(self, sandbox_id: str, watcher: str, wait_s: float = 0.0) -> list[dict[str, Any]]:
        """The watcher's events so far (``{type, name, path}``), waiting up to ``wait_s`` for a first one."""
        read = await self._call(sandbox_id, protocol.OP_WATCH_READ, {"id": watcher, "wait_s": wait_s},
                                _call_timeout(wait_s))
        events = read.get("events", [])
        return [e for e in events if isinstance(e, dict)] if isinstance(events, list) else []

    async def unwatch(self, sandbox_id: str, watcher: str) -> None:
        await self._call(sandbox_id, protocol.OP_WATCH_REMOVE, {"id": watcher})

    # -- code-interpreter contexts (each a process in the guest forked from the warm interpreter)

    async def create_context(self, sandbox_id: str, context_id: str | None = None, cwd: str | None = None,
                             language: str = "python") -> dict[str, Any]:
        args = {"id": context_id, "cwd": cwd, "language": language}
        return await self._call(sandbox_id, protocol.OP_CONTEXTS_CREATE,
                                {k: v for k, v in args.items() if v is not None})

    async def contexts(self, sandbox_id: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_CONTEXTS_LIST, {})

    async def restart_context(self, sandbox_id: str, context_id: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_CONTEXTS_RESTART, {"id": context_id})

    async def remove_context(self, sandbox_id: str, context_id: str) -> None:
        await self._call(sandbox_id, protocol.OP_CONTEXTS_DELETE, {"id": context_id})

    # -- files

    async def read_file(self, sandbox_id: str, path: str) -> FileDownload:
        """The file's first chunk is read now (so a missing file fails here), the rest as iterated."""
        agent = self._agent(sandbox_id)
        first = await self._guarded(sandbox_id, agent.call(protocol.OP_FILES_READ, {"path": path, "offset": 0}))

        async def chunks() -> AsyncIterator[bytes]:
            chunk, offset = first, 0
            while True:
                data = protocol.b64decode(str(chunk.get("data_b64", "")))
                offset += len(data)
                yield data
                if chunk.get("eof") or not data:
                    return
                chunk = await agent.call(protocol.OP_FILES_READ, {"path": path, "offset": offset})

        size = first.get("size")
        return FileDownload(size=size if isinstance(size, int) else None, chunks=chunks())

    async def write_file(self, sandbox_id: str, path: str, body: AsyncIterable[bytes],
                         mode: int | None = None) -> int:
        """Write ``body`` to ``path`` in chunks as it arrives; its size.

        The body is read at the client's speed into a :class:`Spool` while the guest is fed from it
        at its own, so a slow guest makes an upload slower but never leaves the client's TCP window
        shut (some clients abort after 30 s of that: see runtime/spool.py), as long as the daemon's
        spool budget has room.
        """
        agent = self._agent(sandbox_id)
        if self.space is not None and self.spool_dir is not None:
            await asyncio.to_thread(self.space.check, self.spool_dir, 0, f"uploading {path!r} to {sandbox_id}")
        spool = Spool(self.spool_dir, WRITE_CHUNK_BYTES, self.spool_budget, self.space)

        async def receive() -> None:
            buffer = bytearray()
            try:
                async for part in body:
                    buffer.extend(part)
                    while len(buffer) >= WRITE_CHUNK_BYTES:
                        await spool.put(bytes(buffer[:WRITE_CHUNK_BYTES]))
                        del buffer[:WRITE_CHUNK_BYTES]
                if buffer:
                    await spool.put(bytes(buffer))
            except Exception as exc:  # a broken body (client gone, bad encoding), a full disk: the write fails
                await spool.fail(exc)
                return
            await spool.close()

        async def send_all() -> int:
            written, calls = 0, 0
            # An empty body still makes one write: it creates (or truncates) the file.
            while (piece := await spool.get()) is not None or calls == 0:
                piece = piece or b""
                calls += 1
                args: dict[str, Any] = {"path": path, "data_b64": protocol.b64encode(piece), "offset": written,
                                        "truncate": written == 0}
                if mode is not None:
                    args["mode"] = mode
                await agent.call(protocol.OP_FILES_WRITE, args, timeout=WRITE_CHUNK_TIMEOUT_S)
                written += len(piece)
            return written

        receiving = asyncio.get_running_loop().create_task(receive())
        try:
            return await self._guarded(sandbox_id, send_all())
        finally:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
            await spool.release()

    async def list_files(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_LIST, {"path": path})

    async def stat(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_STAT, {"path": path})

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_REMOVE, {"path": path, "recursive": recursive})

    async def make_dir(self, sandbox_id: str, path: str, exist_ok: bool = True) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_MKDIR,
                                {"path": path, "parents": True, **({} if exist_ok else {"exist_ok": False})})

    async def rename(self, sandbox_id: str, src: str, dst: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_RENAME, {"src": src, "dst": dst})

    async def _call(self, sandbox_id: str, op: str, args: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        return await self._agent(sandbox_id).call(op, args, timeout=timeout)
