"""Host side of the guest protocol: one multiplexed connection per sandbox.

Requests are numbered and many may be in flight at once; a reader task routes every frame to the
request it belongs to, so a long ``exec`` never blocks a ``ping``. Events reach the caller as they
arrive through an ``on_event`` callback; a callback that returns an awaitable holds the reader until
it completes (back-pressure for agents without ``flow.pause``: the guest's writes then block).

Everything the guest sends is hostile. A frame that breaks the protocol (a line over the frame
limit, JSON nested past what the parser survives, an id or payload of the wrong type) ends the
connection: every pending call fails at once with the reason, and ``on_violation`` tells the
owner, which kills the sandbox. Only the first line of a connection may be something else, and is
skipped: a restored guest may finish a line its parent began before the snapshot, and a retried
connection may start in the middle of a frame written for the one before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from forkd.guest import protocol
from forkd.runtime.timings import Timings, current
from forkd.vmm.base import VmHandle

EventHandler = Callable[[str, dict[str, Any]], Awaitable[None] | None]


class AgentError(RuntimeError):
    """The agent answered a request with an error frame (or could not be reached)."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}

    @property
    def kind(self) -> str:
        """The agent's codes (bad_request, not_found, timeout, ...) are kinds of ``forkd.errors`` too."""
        return self.code


class AgentUnavailable(AgentError):
    def __init__(self, message: str) -> None:
        super().__init__("agent_unavailable", message)


class ProtocolViolation(Exception):
    """The guest sent a frame the protocol does not allow; the connection cannot be trusted any further."""


def _checked(frame: dict[str, Any]) -> dict[str, Any]:
    """``frame`` if its envelope has the protocol's types, else :class:`ProtocolViolation`."""
    req_id = frame.get("id")
    if req_id is not None and (not isinstance(req_id, int) or isinstance(req_id, bool)):
        raise ProtocolViolation(f"a frame's id is a {type(req_id).__name__}, not an integer")
    if protocol.is_terminal(frame):
        if not isinstance(frame["ok"], bool):
            raise ProtocolViolation("a terminal frame's 'ok' is not a boolean")
        for key in ("result", "error"):
            if frame.get(key) is not None and not isinstance(frame[key], dict):
                raise ProtocolViolation(f"a terminal frame's {key!r} is a {type(frame[key]).__name__}, not an object")
    else:
        if not isinstance(frame.get("event"), str):
            raise ProtocolViolation("an event frame has no string 'event'")
        if frame.get("data") is not None and not isinstance(frame["data"], dict):
            raise ProtocolViolation(f"an event's 'data' is a {type(frame['data']).__name__}, not an object")
    return frame


class _Pending:
    def __init__(self, op: str, on_event: EventHandler | None, timings: Timings | None) -> None:
        self.done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.op = op
        self.on_event = on_event
        self.started = time.monotonic()
        self.timings = timings  # the traced request's (None: not traced)
        self.sent_at = 0.0  # when the request was written (traced only)
        self.answered_at = 0.0  # when its answer's line was read (traced only)


def _trace_stages(pending: _Pending, frame: dict[str, Any]) -> None:
    """Put the guest's stages of a traced call into its Timings: each guest mark ends a stage begun
    at the one before (on the guest's clock), and ``transport`` is what the host waited beyond the
    guest's span: both ways through the VMM's port and the guest kernel (right as far as the guest's
    clock runs at the host's rate, which a TCG guest's need not: bench/roundtrip.py measures it).

    Marks are taken by several guest threads and processes, so they are put in time order first: on one
    vCPU a context woken by the agent's send runs its cell before the agent marks that it sent it.
    """
    timings = pending.timings
    assert timings is not None
    timings.mark("agent_answer", pending.answered_at)
    marks = sorted(protocol.trace_marks(frame) or (), key=lambda mark: mark[1])
    if not marks:
        return
    for (_, before), (stage, at) in zip(marks, marks[1:]):
        timings.elsewhere[f"guest.{stage}"] = timings.elsewhere.get(f"guest.{stage}", 0.0) + (at - before) / 1e9
    span = (marks[-1][1] - marks[0][1]) / 1e9
    timings.elsewhere["guest"] = span
    timings.elsewhere["transport"] = pending.answered_at - pending.sent_at - span


class AgentClient:
    """A connection to one guest agent over its host-side Unix socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        # A fresh random base per connection: an answer written by the guest for an earlier
        # connection (virtio-serial holds writes until a host connects) never matches a new request.
        self._ids = itertools.count(secrets.randbelow(1 << 40) + 1)
        self._pending: dict[int, _Pending] = {}
        self._write_lock = asyncio.Lock()
        self._closed_reason: str | None = None
        self._unsupported: set[str] = set()  # control ops this agent answered unknown_op to
        self._reader_task = asyncio.create_task(self._read_loop())
        self.on_roundtrip: Callable[[str, float], None] | None = None  # (op, seconds) of each answered call
        self.on_violation: Callable[[str], None] | None = None  # the guest broke the protocol (reason)
        # Awaited before every request is sent (unless ``wake=False``): the one point every request to
        # a sandbox passes, where an idle-stopped guest is continued first (runtime/idle.py).
        self.before_request: Callable[[], Awaitable[None]] | None = None
        self.last_request = time.monotonic()  # when the last request was sent

    @classmethod
    async def connect(cls, vm: VmHandle, timeout: float = 10.0) -> AgentClient:
        """Connect to the VM's agent channel, retrying until it is open or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that arrives as what
                # it waits for completes, handing a cancelled caller a connection (or an answer) instead.
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    reader, writer = await vm.open_agent(limit=protocol.MAX_FRAME_BYTES + 1)
                return cls(reader, writer)
            except (FileNotFoundError, ConnectionRefusedError, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise AgentUnavailable(f"cannot connect to the agent of {vm.name}: {exc!r}") from None
                await asyncio.sleep(0.005)

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered (a running command, a watch's long poll, ...)."""
        return len(self._pending)

    async def call(self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = 60.0,
                   on_event: EventHandler | None = None, wake: bool = True) -> dict[str, Any]:
        """Send one request and return its result; raise :class:`AgentError` on an error frame."""
        return await self.wait(await self.start(op, args, on_event=on_event, wake=wake), timeout=timeout)

    async def start(self, op: str, args: dict[str, Any] | None = None, *,
                    on_event: EventHandler | None = None, wake: bool = True) -> int:
        """Send one request and return its id; its events go to ``on_event`` until :meth:`wait` ends it.

        ``wake=False`` skips ``before_request``: for the one who stops and continues the guest itself.
        """
        if self._closed_reason is not None:
            raise AgentUnavailable(self._closed_reason)
        timings = current()
        if timings is not None:
            timings.mark("routed")
        if wake:
            self.last_request = time.monotonic()
            if self.before_request is not None:
                await self.before_request()
                if self._closed_reason is not None:
                    raise AgentUnavailable(self._closed_reason)
                if timings is not None:
                    timings.mark("awake")
        # No await between the hook and the request counting as in flight: a stop checks ``in_flight``.
        req_id = next(self._ids)
        pending = self._pending[req_id] = _Pending(op, on_event, timings)
        try:
            async with self._write_lock:
                self._writer.write(protocol.encode_frame(protocol.request(req_id, op, args, trace=timings is not None)))
                await self._writer.drain()
            if timings is not None:
                pending.sent_at = time.monotonic()
                timings.mark("agent_sent", pending.sent_at)
        except (ConnectionError, OSError) as exc:
            self._pending.pop(req_id, None)
            raise AgentUnavailable(f"connection to the agent failed: {exc}") from None
        except BaseException:
            self._pending.pop(req_id, None)
            raise
        return req_id

    async def wait(self, req_id: int, *, timeout: float | None = 60.0) -> dict[str, Any]:
        """The result of a started request; it is forgotten however the wait ends (later frames are dropped)."""
        pending = self._pending.get(req_id)
        if pending is None:
            raise AgentError(protocol.ERR_INTERNAL, f"request {req_id} is not in flight")
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see connect (a stopping daemon's cancel)
                frame = await asyncio.shield(pending.done)
        except TimeoutError:
            raise AgentError(protocol.ERR_TIMEOUT, f"agent did not answer {pending.op} within {timeout} s") from None
        finally:
            self._pending.pop(req_id, None)
        if pending.timings is not None and not pending.timings.closed:
            _trace_stages(pending, frame)
            pending.timings.mark("agent_resumed")
        if self.on_roundtrip is not None:
            self.on_roundtrip(pending.op, time.monotonic() - pending.started)
        if frame.get("ok"):
            return frame.get("result") or {}
        err = frame.get("error") or {}
        details = {k: v for k, v in err.items() if k not in {"code", "message"}}
        raise AgentError(str(err.get("code", protocol.ERR_INTERNAL)), str(err.get("message", "")), details)

    async def control(self, op: str, req_id: int, timeout: float = 10.0) -> bool:
        """Send a control op (flow.pause, flow.resume, cancel) about request ``req_id``.

        False when this agent does not implement ``op`` (remembered: it is not asked again), so
        callers fall back to what older agents offer.
        """
        if op in self._unsupported:
            return False
        try:
            await self.call(op, {"id": req_id}, timeout=timeout)
        except AgentError as exc:
            if exc.code != protocol.ERR_UNKNOWN_OP:
                raise
            self._unsupported.add(op)
            return False
        return True

    def declined(self, op: str) -> bool:
        """True once the agent answered ``unknown_op`` to control op ``op``."""
        return op in self._unsupported

    async def _read_loop(self) -> None:
        first = True
        try:
            while True:
                try:
                    line = await self._reader.readline()
                except ValueError:  # asyncio's LimitOverrunError: a line longer than any frame may be
                    raise ProtocolViolation(f"a line longer than {protocol.MAX_FRAME_BYTES} bytes") from None
                if not line:
                    self._fail_all("the agent closed the connection (VM stopped?)")
                    return
                read_at = time.monotonic()
                try:
                    frame = protocol.decode_frame(line)
                except protocol.FrameTooDeep:
                    raise ProtocolViolation("a frame nested too deeply to parse") from None
                except protocol.ProtocolError as exc:
                    if first:
                        first = False
                        continue  # the torn end of a frame from before; the request it belonged to is gone
                    raise ProtocolViolation(f"a line that is not a frame ({exc})") from None
                first = False
                await self._route(_checked(frame), read_at)
        except ProtocolViolation as exc:
            self._violated(str(exc))
        except (ConnectionError, OSError) as exc:
            self._fail_all(f"connection to the agent failed: {exc}")
        except asyncio.CancelledError:
            self._fail_all("connection closed")
            raise

    async def _route(self, frame: dict[str, Any], read_at: float) -> None:
        pending = self._pending.get(frame.get("id"))  # type: ignore[arg-type]
        if pending is None:
            return
        if protocol.is_terminal(frame):
            pending.answered_at = read_at
            if not pending.done.done():
                pending.done.set_result(frame)
        elif pending.on_event is not None:
            try:
                result = pending.on_event(frame["event"], frame.get("data") or {})
                if asyncio.iscoroutine(result):
                    await result
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the guest's payload broke its handler (bad base64, wrong field types)
                raise ProtocolViolation(f"a {frame['event']!r} event its handler refused "
                                        f"({type(exc).__name__})") from None

    def _violated(self, detail: str) -> None:
        """Fail everything at once and tell the owner; the guest is not to be trusted any further."""
        self._fail_all(f"the guest broke the agent protocol ({detail}); the sandbox is killed")
        self._writer.close()
        if self.on_violation is not None:
            self.on_violation(detail)

    def _fail_all(self, reason: str) -> None:
        if self._closed_reason is None:
            self._closed_reason = reason
        for pending in self._pending.values():
            if not pending.done.done():
                pending.done.set_exception(AgentUnavailable(reason))

    async def close(self) -> None:
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader_task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


FIRST_ATTEMPT_S = 5.0


async def connect_when_answering(vm: VmHandle, timeout: float, op: str = protocol.OP_PING,
                                 args: dict[str, Any] | None = None) -> tuple[AgentClient, dict[str, Any]]:
    """Connect and send ``op`` until the guest agent answers it; fail fast if the VMM exits.

    A booting or just-restored guest may not have its port open yet, and a connection made in
    that window can be dropped, so a failed attempt is retried on a fresh connection. Each attempt
    waits twice as long as the one before (from ``FIRST_ATTEMPT_S``): an agent that is answering,
    only slowly (a loaded host, a reseed that goes through the warm interpreter), is answered
    instead of being asked again behind its own unanswered requests until the deadline.
    """
    deadline = time.monotonic() + timeout
    last_error = "no attempt"
    attempt_s = FIRST_ATTEMPT_S
    while time.monotonic() < deadline:
        if vm.process.returncode is not None:
            report = await asyncio.to_thread(vm.exit_report)
            raise AgentUnavailable(f"the VM exited with status {vm.process.returncode} before its agent answered"
                                   + (f": {report}" if report else ""))
        remaining = max(0.1, deadline - time.monotonic())
        try:
            client = await AgentClient.connect(vm, timeout=remaining)
        except AgentUnavailable as exc:
            last_error = exc.message
            continue
        try:
            return client, await client.call(op, args, timeout=min(remaining, attempt_s))
        except AgentUnavailable as exc:
            last_error = exc.message
            await client.close()
            await asyncio.sleep(0.05)
        except AgentError as exc:
            if exc.code != protocol.ERR_TIMEOUT:
                await client.close()
                raise
            last_error = exc.message
            attempt_s *= 2
            await client.close()
    raise AgentUnavailable(f"guest agent did not answer within {timeout:.0f} s ({last_error})")
