"""An exec or run_code call in flight, its output bounded and flow-controlled.

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
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError, AgentUnavailable
from forkd.runtime.results import Data, Event, Notice, Output, Started

log = logging.getLogger("forkd.sessions")

CONTROL_TIMEOUT_S = 10.0
HOLD_FACTOR = 4  # a stream's queue may reach this many buffers before the connection's reader is held
_ending: set[asyncio.Task[None]] = set()  # guest calls being ended after their caller left
# Turns a lost agent connection into the error the caller should see (the sandbox ended, say).
Explain = Callable[[AgentUnavailable], Awaitable[Exception]]


def encoded_size(name: str, data: dict[str, Any]) -> int:
    """What an event costs the daemon: its payload as the guest encoded it (the frame was at most
    ``protocol.MAX_FRAME_BYTES`` on the wire, so this is bounded too)."""
    return len(name) + len(json.dumps(data, separators=(",", ":")))


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
                 output_limit: int | None, buffer_bytes: int, explain: Explain | None = None,
                 raw: bool = False, notices: bool = True) -> None:
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
        # raw: output stays bytes (Data events), a terminal's included; else text (Output events)
        self._raw = raw
        self._notices = notices  # False: events other than output are not wanted (not held, not counted)
        self._streams = {protocol.EVENT_STDOUT, protocol.EVENT_STDERR, *([protocol.EVENT_PTY] if raw else [])}
        self._arrived = asyncio.Event()
        self._drained = asyncio.Event()
        self._paused = False
        self._closed = False
        self._req_id: int | None = None
        self._result: asyncio.Task[dict[str, Any]] | None = None
        self._controls: set[asyncio.Task[Any]] = set()
        self.pid: int | None = None
        self.truncated = False

    @property
    def paused(self) -> bool:
        """True while the guest was asked to pause this call because its reader fell behind."""
        return self._paused

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
        elif name in self._streams:
            chunk = _payload(data)
            if self._limit is not None and self._forwarded + len(chunk) > self._limit:
                chunk = chunk[:max(0, self._limit - self._forwarded)]
                self.truncated = True
            if not chunk:
                return None
            size = len(chunk)
            self._forwarded += size
            event = Data(name, chunk) if self._raw else Output(name, self._decoders[name].decode(chunk))  # type: ignore[arg-type]
        elif not self._notices:
            return None
        else:
            # Rich results (display(), charts) and any other event count what they cost to hold: their
            # encoded size. One that does not fit in what is left of the budget is dropped whole.
            size = encoded_size(name, data)
            if self._limit is not None and self._forwarded + size > self._limit:
                self.truncated = True
                return None
            self._forwarded += size
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

    def interrupt(self) -> None:
        """Ask the guest to end the call (as :meth:`cancel` does) but keep reading its output and result."""
        if self._req_id is not None and self._result is not None and not self._result.done():
            ending = asyncio.create_task(_end_in_guest(self._agent, self._req_id, self.pid))
            _ending.add(ending)
            ending.add_done_callback(_ending.discard)

    def cancel(self) -> None:
        """End the call: drop its output and end it in the guest (see :meth:`interrupt`).

        Not a coroutine on purpose: it is called from ``finally`` blocks of a stream whose client
        left, where the surrounding cancel scope would cancel any await; the guest is told from a
        task of its own.
        """
        if self._closed:
            return
        self._closed = True
        self._queue.clear()
        self._drained.set()
        self.interrupt()
        if self._result is not None and not self._result.done():
            self._result.cancel()

    def flush(self) -> list[Output]:
        """What the decoders still hold (a character split at the end of the output)."""
        return [Output(name, tail) for name, decoder in self._decoders.items()  # type: ignore[misc]
                if (tail := decoder.decode(b"", final=True))]


async def _end_in_guest(agent: AgentClient, req_id: int, pid: int | None) -> None:
    """Ask the agent to cancel the request; a command of an agent without ``cancel`` is killed instead.

    The agent ends a cancelled call gently: a cell gets SIGINT (its interpreter raises
    KeyboardInterrupt, the context lives on), a command's process group SIGINT and, if it is still
    there after a grace period, SIGKILL (docs/guest-protocol.md, "cancel").
    """
    try:
        if await agent.control(protocol.OP_CANCEL, req_id, timeout=CONTROL_TIMEOUT_S) or pid is None:
            return
        await agent.call(protocol.OP_PROC_KILL, {"pid": pid, "signal": int(signal.SIGKILL)}, timeout=CONTROL_TIMEOUT_S)
    except AgentError as exc:
        log.debug("ending request %d in the guest: %s", req_id, exc)
