"""envd's ``process.Process`` service, an adapter over the runtime's sessions (commands, terminals).

A command started here outlives the request that started it (as in E2B, a client may disconnect
and ``Connect`` again later): its session Execution is read by a task owned by the sandbox's
process table, which fans its events out to every attached stream. Each stream has a bounded
outbox (bytes of output waiting for its client) and a process takes a bounded number of streams;
a client that stops reading is dropped, not buffered without end. As in envd, the Start request's
``Connect-Timeout-Ms`` (the SDKs' ``timeout``, 60 s by default, none when 0) is the command's
lifetime: when it passes the command is ended in the guest (SIGINT, then SIGKILL after a grace
period; a terminal is killed).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import signal as signals
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from forkd.e2b.errors import ConnectError
from forkd.e2b.rpc import Call, Message, Method
from forkd.runtime.agent_client import AgentError
from forkd.runtime.execution import Execution
from forkd.runtime.results import CommandSpec, Data, Started
from forkd.runtime.sandboxes import LiveSandbox
from forkd.runtime.sessions import Sessions

STREAM_BUFFER_BYTES = 1 << 20  # output waiting for one attached stream's client
MAX_STREAMS = 8  # streams attached to one process at once (Start, then each Connect)
_EVENT_OVERHEAD = 64  # what a message costs besides its data
FINISHED_KEPT = 64
_SIGNALS = {"SIGNAL_SIGKILL": signals.SIGKILL, "SIGNAL_SIGTERM": signals.SIGTERM}
_END = object()


class _Outbox:
    """One attached stream's queue, bounded by the bytes it holds rather than by a count of events."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[Any, int]] = asyncio.Queue()
        self.bytes = 0

    def offer(self, item: Any, size: int) -> bool:
        """Queue ``item`` if its ``size`` fits in the budget."""
        if self.bytes + size > STREAM_BUFFER_BYTES:
            return False
        self.force(item, size)
        return True

    def force(self, item: Any, size: int = 0) -> None:
        """The end of a stream always fits (it is the last item)."""
        self.bytes += size
        self.queue.put_nowait((item, size))

    async def get(self) -> Any:
        item, size = await self.queue.get()
        self.bytes -= size
        return item


@dataclass
class _Process:
    config: dict[str, Any]
    tag: str | None
    pty: bool = False  # started on a pseudo-terminal (the agent's pty.* ops address it)
    pid: int | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    end: Message | None = None
    failure: BaseException | None = None
    streams: set[_Outbox] = field(default_factory=set)
    task: asyncio.Task[None] | None = None

    def publish(self, item: Any) -> None:
        size = _EVENT_OVERHEAD + (len(json.dumps(item)) if isinstance(item, dict) else 0)
        for outbox in list(self.streams):
            if not outbox.offer(item, size):  # a client that stopped reading loses its stream, not our memory
                self.streams.discard(outbox)
                outbox.force(ConnectError("resource_exhausted", f"the client read the output too slowly: over "
                                                                f"{STREAM_BUFFER_BYTES} bytes were waiting for it"))

    def attach(self) -> _Outbox:
        outbox = _Outbox()
        if self.end is not None or self.failure is not None:
            outbox.force(_END)
        elif len(self.streams) >= MAX_STREAMS:
            raise ConnectError("resource_exhausted", f"{MAX_STREAMS} streams are attached to this process already; "
                                                     "close one before connecting again")
        else:
            self.streams.add(outbox)
        return outbox


def _event(**event: Any) -> Message:
    return {"event": event}


def _end_event(result: dict[str, Any]) -> Message:
    sig = result.get("signal")
    if sig:
        name = signals.Signals(sig).name.removeprefix("SIG").lower() if sig in signals.Signals._value2member_map_ else str(sig)
        return _event(end={"exitCode": -1, "exited": False, "status": f"signal: {name}"})
    code = int(result.get("exit_code", 0))
    return _event(end={"exitCode": code, "exited": True, "status": f"exit status {code}"})


class ProcessTable:
    """The commands the E2B front started in one sandbox, by pid."""

    def __init__(self) -> None:
        self.processes: dict[int, _Process] = {}

    def find(self, selector: Message) -> tuple[int, _Process | None]:
        """The pid a ``ProcessSelector`` names (``pid`` or ``tag``), and our record of it if we started it."""
        selector = selector or {}
        if "tag" in selector:
            for pid, process in self.processes.items():
                if process.tag == selector["tag"] and process.end is None:
                    return pid, process
            raise ConnectError("not_found", f"no running process tagged {selector['tag']!r}")
        pid = selector.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            raise ConnectError("invalid_argument", "the process selector needs a pid or a tag")
        return pid, self.processes.get(pid)

    def forget_finished(self) -> None:
        finished = [pid for pid, p in self.processes.items() if p.end is not None or p.failure is not None]
        for pid in finished[:-FINISHED_KEPT]:
            del self.processes[pid]


class ProcessService:
    """The RPC handlers; one process table per running sandbox (dropped with the sandbox)."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self._tables: dict[str, tuple[LiveSandbox, ProcessTable]] = {}

    def table(self, live: LiveSandbox) -> ProcessTable:
        """This sandbox's table; tables of sandboxes that ended are dropped on the way."""
        for sandbox_id, (other, _) in list(self._tables.items()):
            if other.watcher is not None and other.watcher.done():
                del self._tables[sandbox_id]
        known = self._tables.get(live.record.id)
        if known is None or known[0] is not live:
            known = self._tables[live.record.id] = (live, ProcessTable())
        return known[1]

    def methods(self) -> dict[str, Method]:
        return {
            "/process.Process/Start": Method("server_stream", self.start),
            "/process.Process/Connect": Method("server_stream", self.connect),
            "/process.Process/List": Method("unary", self.list),
            "/process.Process/SendInput": Method("unary", self.send_input),
            "/process.Process/StreamInput": Method("client_stream", self.stream_input),
            "/process.Process/SendSignal": Method("unary", self.send_signal),
            "/process.Process/CloseStdin": Method("unary", self.close_stdin),
            "/process.Process/Update": Method("unary", self.update),
        }

    async def start(self, call: Call, message: Message) -> AsyncIterator[Message]:
        config = message.get("process") or {}
        cmd, args, envs = config.get("cmd"), config.get("args") or [], config.get("envs") or {}
        if not isinstance(cmd, str) or not cmd:
            raise ConnectError("invalid_argument", "process.cmd is required")
        if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
            raise ConnectError("invalid_argument", "process.args must be a list of strings")
        if not (isinstance(envs, dict) and all(isinstance(v, str) for v in envs.values())):
            raise ConnectError("invalid_argument", "process.envs must map names to strings")
        cwd = config.get("cwd") if isinstance(config.get("cwd"), str) and config.get("cwd") else None
        pty = message.get("pty") if isinstance(message.get("pty"), dict) else None  # {} too: a default-size PTY
        # E2B's default is no stdin (readers see EOF at once); a PTY's input is its terminal.
        stdin = None if pty is not None or message.get("stdin") is True else b""
        spec = CommandSpec(argv=[cmd, *args], env=envs, cwd=cwd, stdin=stdin, timeout_s=None)
        lifetime_s = _lifetime_seconds(call)
        process = _Process(config={"cmd": cmd, "args": args, "envs": envs, **({"cwd": cwd} if cwd else {})},
                           tag=message.get("tag") if isinstance(message.get("tag"), str) else None, pty=pty is not None)
        queue = process.attach()
        sandbox_id = call.live.record.id
        if pty is not None:
            started = self.sessions.start_pty(sandbox_id, spec, **_size(pty))
        else:
            started = self.sessions.start_exec(sandbox_id, spec, raw=True)
        process.task = asyncio.get_running_loop().create_task(self._run(call.live, process, started, lifetime_s))
        return self._stream(process, queue, call)

    async def _run(self, live: LiveSandbox, process: _Process, started: Awaitable[Execution],
                   lifetime_s: float | None) -> None:
        """Read the command's Execution to its end, publishing its events; end it when its lifetime passes."""
        table = self.table(live)
        execution: Execution | None = None
        timer: asyncio.TimerHandle | None = None
        try:
            execution = await started
            if lifetime_s is not None:
                timer = asyncio.get_running_loop().call_later(lifetime_s, self._expire, live, process, execution)
            async for event in execution:
                if isinstance(event, Started):
                    process.pid = event.pid
                    table.processes[process.pid] = process
                    process.started.set()
                    process.publish(_event(start={"pid": process.pid}))
                elif isinstance(event, Data):
                    process.publish(_event(data={event.stream: base64.b64encode(event.data).decode()}))
            process.end = _end_event(await execution.raw_result())
            process.publish(process.end)
        except Exception as exc:  # reported to every attached stream
            process.failure = exc
            process.publish(exc)
        finally:
            if timer is not None:
                timer.cancel()
            if execution is not None:
                execution.cancel()  # a no-op once it answered; else (this task was cancelled) end it
            process.started.set()
            process.publish(_END)
            process.streams.clear()
            table.forget_finished()

    def _expire(self, live: LiveSandbox, process: _Process, execution: Execution) -> None:
        """The command outlived its Start request's timeout: end it in the guest, as envd does."""
        if not process.pty:
            execution.interrupt()
        elif process.pid is not None:
            task = asyncio.get_running_loop().create_task(self._kill_terminal(live.record.id, process.pid))
            _EXPIRING.add(task)
            task.add_done_callback(_EXPIRING.discard)

    async def _kill_terminal(self, sandbox_id: str, pid: int) -> None:
        with contextlib.suppress(AgentError):  # it ended (or the sandbox did) meanwhile
            await self.sessions.pty_signal(sandbox_id, pid, int(signals.SIGKILL))

    async def _stream(self, process: _Process, queue: _Outbox, call: Call) -> AsyncIterator[Message]:
        """The process's events; keepalives only once the first (``start``) went out: the SDKs
        take the first message of a stream as the start event (a slow guest delays it)."""
        keepalive, started = _keepalive_seconds(call), False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), keepalive if started else None)
                except asyncio.TimeoutError:
                    yield _event(keepalive={})
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                started = True
                yield item
        finally:
            process.streams.discard(queue)

    async def connect(self, call: Call, message: Message) -> AsyncIterator[Message]:
        pid, process = self.table(call.live).find(message.get("process") or {})
        if process is None or process.end is not None or process.failure is not None:
            raise ConnectError("not_found", f"process {pid} is not running or was not started through the E2B API")
        queue = process.attach()
        queue.force(_event(start={"pid": pid}))  # first, as envd sends it
        return self._stream(process, queue, call)

    async def list(self, call: Call, message: Message) -> Message:
        table = self.table(call.live)
        listed = await self.sessions.processes(call.live.record.id)
        out = []
        for entry in listed.get("processes", []):
            if not entry.get("running"):
                continue
            ours = table.processes.get(entry["pid"])
            if ours is not None:
                out.append({"pid": entry["pid"], "config": ours.config, **({"tag": ours.tag} if ours.tag else {})})
            elif entry.get("argv"):
                out.append({"pid": entry["pid"], "config": {"cmd": entry["argv"][0], "args": entry["argv"][1:]}})
            else:
                out.append({"pid": entry["pid"], "config": {"cmd": "/bin/sh", "args": ["-c", entry.get("shell", "")]}})
        listed_pids = {entry["pid"] for entry in out}
        out += [{"pid": pid, "config": p.config, **({"tag": p.tag} if p.tag else {})}
                for pid, p in table.processes.items() if p.pty and p.end is None and p.failure is None
                and pid not in listed_pids]
        return {"processes": out}

    async def _stdin(self, live: LiveSandbox, selector: Message, data: bytes = b"", eof: bool = False,
                     pty: bool = False) -> None:
        """Input for a process: its stdin pipe, or the terminal of a PTY session."""
        pid, process = self.table(live).find(selector)
        on_pty = process is not None and process.pty
        if pty != on_pty:
            raise ConnectError("invalid_argument", f"process {pid} {'has no' if pty else 'runs on a'} PTY: send "
                                                   f"input.{'stdin' if pty else 'pty'} instead")
        if on_pty:
            if eof:
                raise ConnectError("failed_precondition", "a PTY has no stdin to close; send Ctrl+D (0x04) instead")
            await self.sessions.pty_input(live.record.id, pid, data)
        else:
            await self.sessions.write_stdin(live.record.id, pid, data, eof)

    @staticmethod
    def _input(message: Message) -> tuple[bytes, bool]:
        """The input's bytes and whether they are for a PTY."""
        given = message.get("input") or {}
        pty = "pty" in given
        data = given.get("pty" if pty else "stdin", "")
        if not isinstance(data, str):
            raise ConnectError("invalid_argument", "input data must be base64 bytes")
        try:
            return base64.b64decode(data, validate=True), pty
        except (binascii.Error, ValueError):
            raise ConnectError("invalid_argument", "input data is not valid base64") from None

    async def send_input(self, call: Call, message: Message) -> Message:
        data, pty = self._input(message)
        await self._stdin(call.live, message.get("process") or {}, data, pty=pty)
        return {}

    async def stream_input(self, call: Call, messages: AsyncIterator[Message]) -> Message:
        selector: Message | None = None
        async for message in messages:
            if "start" in message:
                selector = (message["start"] or {}).get("process") or {}
            elif "data" in message:
                if selector is None:
                    raise ConnectError("failed_precondition", "StreamInput needs a start message before data")
                data, pty = self._input(message["data"] or {})
                await self._stdin(call.live, selector, data, pty=pty)
        return {}

    async def send_signal(self, call: Call, message: Message) -> Message:
        pid, process = self.table(call.live).find(message.get("process") or {})
        given = message.get("signal")
        sig = _SIGNALS.get(given) if isinstance(given, str) else given
        if sig not in (signals.SIGKILL, signals.SIGTERM):
            raise ConnectError("invalid_argument", f"signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM, not {given!r}")
        try:
            if process is not None and process.pty:
                await self.sessions.pty_signal(call.live.record.id, pid, int(sig))
            else:
                await self.sessions.signal(call.live.record.id, pid, int(sig))
        except AgentError as exc:
            if exc.code == "not_found":
                raise ConnectError("not_found", f"process {pid} not found") from None
            raise
        return {}

    async def close_stdin(self, call: Call, message: Message) -> Message:
        await self._stdin(call.live, message.get("process") or {}, eof=True)
        return {}

    async def update(self, call: Call, message: Message) -> Message:
        pid, process = self.table(call.live).find(message.get("process") or {})
        if process is None or not process.pty:
            raise ConnectError("invalid_argument", f"process {pid} has no PTY to resize")
        if message.get("pty"):
            await self.sessions.pty_resize(call.live.record.id, pid, **_size(message["pty"]))
        return {}


def _size(pty: Any) -> dict[str, int]:
    """A PTY message's size as the agent's rows/cols (envd's defaults when absent)."""
    size = (pty.get("size") if isinstance(pty, dict) else None) or {}
    rows, cols = size.get("rows", 24), size.get("cols", 80)
    if not all(isinstance(v, int) and 1 <= v <= 10_000 for v in (rows, cols)):
        raise ConnectError("invalid_argument", "pty.size needs rows and cols between 1 and 10000")
    return {"rows": rows, "cols": cols}


def _lifetime_seconds(call: Call) -> float | None:
    """The command's lifetime from the Start request's ``Connect-Timeout-Ms`` (None: absent or 0)."""
    raw = call.request.headers.get("connect-timeout-ms", "")
    if not raw.isdigit() or len(raw) > 10:
        return None
    return int(raw) / 1000 or None


_EXPIRING: set[asyncio.Task[None]] = set()  # terminals being killed at the end of their lifetime


def _keepalive_seconds(call: Call) -> float | None:
    raw = call.request.headers.get("keepalive-ping-interval", "")
    return float(raw) if raw.isdigit() and 0 < int(raw) <= 3600 else None
