"""Sessions: running things inside a live sandbox — commands, Python cells, files and processes.

The one place guest-protocol calls become typed results and events. The daemon's routes use it, and
so does every other front end that talks to sandboxes (the E2B front, MCP through the daemon): plain
``async`` methods for calls that answer once, an :class:`Execution` (an async iterator of typed
events, then a result) for commands and cells whose output streams.

Guest output is hostile, so it is bounded here: a call forwards at most ``output_limit`` bytes (the
guest is asked to stop sending past it, and the host drops anything beyond it in any case) and
reports ``truncated``; a stream queues at most ``stream_buffer_bytes`` for a slow reader before the
guest is told to pause the command (``flow.pause``: the process then blocks on its writes). An agent
without flow control is throttled by holding the connection's reader instead. Cancelling a call (the
HTTP client left) ends it in the guest: ``cancel``, or with older agents a kill of its process group.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import logging
import signal
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError, AgentUnavailable
from forkd.runtime.options import OutputLimits
from forkd.runtime.sandboxes import SandboxEnded
from forkd.runtime.spool import Spool

log = logging.getLogger("forkd.sessions")

MAX_TIMEOUT_S = 24 * 3600  # longest a command, cell or eval may be given
CALL_GRACE_S = 30.0  # the host waits this much longer than the guest's own timeout
CONTROL_TIMEOUT_S = 10.0
WRITE_CHUNK_BYTES = protocol.FILE_CHUNK_BYTES  # one files.write call
# For one chunk to be written once the guest has read it: minutes, since a TCG guest on a loaded host
# is starved for that long (an agent that dies closes its connection and fails the write at once).
WRITE_CHUNK_TIMEOUT_S = 300.0
_ending: set[asyncio.Task[None]] = set()  # guest calls being ended after their caller left
HOLD_FACTOR = 4  # a stream's queue may reach this many buffers before the connection's reader is held
Stream = Literal["stdout", "stderr"]
T = TypeVar("T")
Explain = Callable[[AgentUnavailable], Awaitable[Exception]]


# ---------------------------------------------------------------------------------------------
# What callers get back
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    """exec: the command runs as ``pid`` (use it for stdin, signals and ``processes``)."""

    pid: int


@dataclass(frozen=True)
class Output:
    stream: Stream
    text: str


@dataclass(frozen=True)
class Notice:
    """An event this host does not model (a newer agent's); passed on as the agent sent it."""

    name: str
    data: dict[str, Any]


Event = Started | Output | Notice


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    signal: int | None
    timed_out: bool
    duration_s: float
    stdout: str = ""  # empty when the output was streamed as events instead
    stderr: str = ""
    truncated: bool = False  # output went past the call's budget; the rest was dropped
    extra: dict[str, Any] = field(default_factory=dict)  # fields a newer agent adds

    def to_dict(self) -> dict[str, Any]:
        return {**self.extra, "exit_code": self.exit_code, "signal": self.signal, "timed_out": self.timed_out,
                "duration_s": self.duration_s, "stdout": self.stdout, "stderr": self.stderr,
                "truncated": self.truncated}


@dataclass(frozen=True)
class CodeResult:
    value: str | None  # repr of the last expression, if any
    value_json: Any
    error: dict[str, Any] | None  # {name, value, traceback} when the cell raised
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**self.extra, "value": self.value, "value_json": self.value_json, "error": self.error,
                "stdout": self.stdout, "stderr": self.stderr, "truncated": self.truncated}


@dataclass(frozen=True)
class CommandSpec:
    """One command: a shell string (``/bin/sh -c``) or an argv list."""

    cmd: str | None = None
    argv: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)  # over the sandbox's default envs
    cwd: str | None = None
    stdin: bytes | None = None  # written, then closed; None leaves stdin open for write_stdin
    timeout_s: float | None = 60.0
    user: str | None = None
    warm: bool = False  # a python3 argv forked from the guest's warm template (see docs/guest-protocol.md)

    def __post_init__(self) -> None:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError("give exactly one of 'cmd' (a shell string) or 'argv' (a list)")


@dataclass(frozen=True)
class CellSpec:
    code: str
    context: str = "default"
    timeout_s: float | None = None


@dataclass(frozen=True)
class FileDownload:
    """A file being read from the guest in chunks of at most ``protocol.FILE_CHUNK_BYTES``."""

    size: int | None
    chunks: AsyncIterator[bytes]


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


# ---------------------------------------------------------------------------------------------
# A call whose output streams
# ---------------------------------------------------------------------------------------------

def _payload(data: dict[str, Any]) -> bytes:
    """exec sends bytes (``data_b64``), run_code text (``text``); both are counted as bytes."""
    if "data_b64" in data:
        return protocol.b64decode(str(data["data_b64"]))
    return str(data.get("text", "")).encode()


class Execution:
    """An exec or run_code call in flight: iterate its events, then await :meth:`result`.

    Leaving the iteration early (or :meth:`cancel`) ends the call in the guest. At most
    ``buffer_bytes`` of output wait in memory for the reader; past that the guest is paused.
    """

    def __init__(self, agent: AgentClient, op: str, args: dict[str, Any], timeout: float | None,
                 output_limit: int | None, buffer_bytes: int, explain: Explain | None = None) -> None:
        self._agent = agent
        self._explain = explain
        self._op = op
        self._args = {**args, **({"output_limit": output_limit} if output_limit is not None else {})}
        self._timeout = timeout
        self._limit = output_limit
        self._buffer_bytes = buffer_bytes
        self._queue: collections.deque[tuple[Event, int]] = collections.deque()
        self._queued_bytes = 0
        self._forwarded = 0
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace")
                          for name in (protocol.EVENT_STDOUT, protocol.EVENT_STDERR)}
        self._arrived = asyncio.Event()
        self._drained = asyncio.Event()
        self._paused = False
        self._closed = False
        self._req_id: int | None = None
        self._result: asyncio.Task[dict[str, Any]] | None = None
        self._controls: set[asyncio.Task[Any]] = set()
        self.pid: int | None = None
        self.truncated = False

    async def start(self) -> Execution:
        self._req_id = await self._agent.start(self._op, self._args, on_event=self._on_event)
        self._result = asyncio.create_task(self._agent.wait(self._req_id, timeout=self._timeout))
        self._result.add_done_callback(self._ended)
        return self

    def _ended(self, _: object) -> None:
        # No event of this call is routed any more: wake the reader and release a held connection.
        self._arrived.set()
        self._drained.set()

    # -- producer side: called by the agent connection's reader for every event frame

    def _on_event(self, name: str, data: dict[str, Any]) -> Any:
        if self._closed:
            return None
        size = 0
        event: Event
        if name == protocol.EVENT_STARTED and isinstance(data.get("pid"), int):
            self.pid = data["pid"]
            event = Started(self.pid)
        elif name in self._decoders:
            chunk = _payload(data)
            if self._limit is not None and self._forwarded + len(chunk) > self._limit:
                chunk = chunk[:max(0, self._limit - self._forwarded)]
                self.truncated = True
            if not chunk:
                return None
            size = len(chunk)
            self._forwarded += size
            event = Output(name, self._decoders[name].decode(chunk))  # type: ignore[arg-type]
        else:
            event = Notice(name, data)
        self._queue.append((event, size))
        self._queued_bytes += size
        self._arrived.set()
        if self._queued_bytes > self._buffer_bytes:
            return self._hold()
        return None

    def _hold(self) -> Any:
        """Over the buffer: pause the command in the guest, or hold the reader if it cannot be paused.

        The reader is also held past ``HOLD_FACTOR`` buffers, while a pause is not answered yet (its
        answer queues behind the output already sent) or when an agent ignores it.
        """
        if self._agent.declined(protocol.OP_FLOW_PAUSE) or self._queued_bytes > HOLD_FACTOR * self._buffer_bytes:
            self._drained.clear()
            return self._drained.wait()
        if not self._paused:
            self._paused = True
            self._control(protocol.OP_FLOW_PAUSE)
        return None

    def _control(self, op: str) -> None:
        """Send a control op about this call without waiting for it (the reader may be busy with us)."""
        async def send() -> None:
            with contextlib.suppress(AgentError):
                await self._agent.control(op, self._req_id or 0, timeout=CONTROL_TIMEOUT_S)
        task = asyncio.create_task(send())
        self._controls.add(task)
        task.add_done_callback(self._controls.discard)

    # -- consumer side

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        assert self._result is not None, "start() the execution first"
        try:
            while True:
                while self._queue:
                    event, size = self._queue.popleft()
                    self._queued_bytes -= size
                    if self._queued_bytes <= self._buffer_bytes // 2:
                        self._drained.set()
                        if self._paused:
                            self._paused = False
                            self._control(protocol.OP_FLOW_RESUME)
                    yield event
                if self._result.done():
                    return
                self._arrived.clear()
                if not self._queue and not self._result.done():
                    await self._arrived.wait()
        finally:
            if not self._result.done():
                self.cancel()

    async def raw_result(self) -> dict[str, Any]:
        """The agent's terminal result; raises :class:`AgentError` when the call failed.

        When the host gave up waiting (the guest's own timeout did not end it), the call is ended
        in the guest too, so it does not run on unseen.
        """
        assert self._result is not None, "start() the execution first"
        try:
            return await self._result
        except AgentUnavailable as exc:
            if self._explain is None:
                raise
            raise await self._explain(exc) from None
        except AgentError as exc:
            if exc.code == protocol.ERR_TIMEOUT and self._req_id is not None:
                await _end_in_guest(self._agent, self._req_id, self.pid)
            raise

    def cancel(self) -> None:
        """End the call: drop its output and end it in the guest (``cancel``, and a kill of a command).

        Not a coroutine on purpose: it is called from ``finally`` blocks of a stream whose client
        left, where the surrounding cancel scope would cancel any await; the guest is told from a
        task of its own.
        """
        if self._closed:
            return
        self._closed = True
        self._queue.clear()
        self._drained.set()
        if self._result is not None and not self._result.done():
            self._result.cancel()
        if self._req_id is not None:
            ending = asyncio.create_task(_end_in_guest(self._agent, self._req_id, self.pid))
            _ending.add(ending)
            ending.add_done_callback(_ending.discard)

    def flush(self) -> list[Output]:
        """What the decoders still hold (a character split at the end of the output)."""
        return [Output(name, tail) for name, decoder in self._decoders.items()  # type: ignore[misc]
                if (tail := decoder.decode(b"", final=True))]


async def _end_in_guest(agent: AgentClient, req_id: int, pid: int | None) -> None:
    """Ask the agent to cancel the request and, for a command, also kill its process group at once.

    Both are sent without waiting for the other: an agent without ``cancel`` still kills, and the
    kill acts as soon as the agent reads it even while its answers queue behind output in flight.
    """
    calls = [agent.control(protocol.OP_CANCEL, req_id, timeout=CONTROL_TIMEOUT_S)]
    if pid is not None:
        calls.append(agent.call(protocol.OP_PROC_KILL, {"pid": pid, "signal": int(signal.SIGKILL)},
                                timeout=CONTROL_TIMEOUT_S))
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(outcome, Exception):
            log.debug("ending request %d in the guest: %s", req_id, outcome)


# ---------------------------------------------------------------------------------------------
# The service
# ---------------------------------------------------------------------------------------------

def _call_timeout(timeout_s: float | None) -> float:
    return (timeout_s or MAX_TIMEOUT_S) + CALL_GRACE_S


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _command_result(raw: dict[str, Any], stdout: str, stderr: str, truncated: bool) -> CommandResult:
    known = {"exit_code", "signal", "timed_out", "duration_s", "stdout", "stderr", "truncated"}
    duration = raw.get("duration_s")
    return CommandResult(
        exit_code=_optional_int(raw.get("exit_code")) if _optional_int(raw.get("exit_code")) is not None else -1,
        signal=_optional_int(raw.get("signal")),
        timed_out=raw.get("timed_out") is True,
        duration_s=float(duration) if isinstance(duration, int | float) else 0.0,
        stdout=stdout, stderr=stderr, truncated=truncated or raw.get("truncated") is True,
        extra={k: v for k, v in raw.items() if k not in known})


def _code_result(raw: dict[str, Any], stdout: str, stderr: str, truncated: bool) -> CodeResult:
    known = {"value", "value_json", "error", "stdout", "stderr", "truncated"}
    value, error = raw.get("value"), raw.get("error")
    return CodeResult(value=value if isinstance(value, str) else None, value_json=raw.get("value_json"),
                      error=error if isinstance(error, dict) else None, stdout=stdout, stderr=stderr,
                      truncated=truncated or raw.get("truncated") is True,
                      extra={k: v for k, v in raw.items() if k not in known})


class Sessions:
    def __init__(self, sandboxes: SandboxLookup, limits: OutputLimits | None = None,
                 spool_dir: Path | None = None) -> None:
        self.sandboxes = sandboxes
        self.limits = limits or OutputLimits()
        self.spool_dir = spool_dir  # where uploads wait for their guest (None: the system's temp dir)

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
                   output_limit: int | None) -> Execution:
        return Execution(self._agent(sandbox_id), op, args, _call_timeout(timeout_s), output_limit,
                         self.limits.stream_buffer_bytes, self._explainer(sandbox_id))

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

    async def start_exec(self, sandbox_id: str, spec: CommandSpec) -> Execution:
        """Start a command and return it running: iterate its events, then ``command_result``."""
        execution = self._execution(sandbox_id, protocol.OP_EXEC, self._exec_args(sandbox_id, spec), spec.timeout_s,
                                    self.limits.stream_bytes)
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
                                    self.limits.result_bytes)
        raw, stdout, stderr = await self._guarded(sandbox_id, self._collect(execution))
        return _command_result(raw, stdout, stderr, execution.truncated)

    async def run_code(self, sandbox_id: str, spec: CellSpec) -> CodeResult:
        """Run a cell to its end; what it printed (up to the result budget) comes back in the result."""
        execution = self._execution(sandbox_id, protocol.OP_RUN_CODE, self._cell_args(spec), spec.timeout_s,
                                    self.limits.result_bytes)
        raw, stdout, stderr = await self._guarded(sandbox_id, self._collect(execution))
        return _code_result(raw, stdout, stderr, execution.truncated)

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
        return _command_result(raw, "", "", execution.truncated)

    @staticmethod
    def cell_result(execution: Execution, raw: dict[str, Any]) -> CodeResult:
        return _code_result(raw, "", "", execution.truncated)

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
        shut (some clients abort after 30 s of that: see runtime/spool.py).
        """
        agent = self._agent(sandbox_id)
        spool = Spool(self.spool_dir, WRITE_CHUNK_BYTES)

        async def receive() -> None:
            buffer, spooled = bytearray(), 0
            try:
                async for part in body:
                    buffer.extend(part)
                    while len(buffer) >= WRITE_CHUNK_BYTES:
                        await spool.put(bytes(buffer[:WRITE_CHUNK_BYTES]))
                        del buffer[:WRITE_CHUNK_BYTES]
                        spooled += 1
                if buffer or not spooled:  # an empty body still creates (or truncates) the file
                    await spool.put(bytes(buffer))
            except Exception as exc:  # a broken body (client gone, bad encoding) ends the write with its error
                spool.fail(exc)
                return
            await spool.close()

        async def send_all() -> int:
            written = 0
            while (piece := await spool.get()) is not None:
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
            spool.discard()

    async def list_files(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_LIST, {"path": path})

    async def stat(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_STAT, {"path": path})

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_REMOVE, {"path": path, "recursive": recursive})

    async def make_dir(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_MKDIR, {"path": path, "parents": True})

    async def rename(self, sandbox_id: str, src: str, dst: str) -> dict[str, Any]:
        return await self._call(sandbox_id, protocol.OP_FILES_RENAME, {"src": src, "dst": dst})

    async def _call(self, sandbox_id: str, op: str, args: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        return await self._agent(sandbox_id).call(op, args, timeout=timeout)


__all__ = ["CellSpec", "CodeResult", "CommandResult", "CommandSpec", "Event", "Execution", "FileDownload",
           "MAX_TIMEOUT_S", "Notice", "Output", "SandboxLookup", "Sessions", "Started"]
