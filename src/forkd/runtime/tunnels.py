"""Tunnels: byte streams to TCP ports programs listen on inside a live sandbox.

Why through the agent and not the network: children default to ``net=none`` (no link at all), and
a ``nat`` child's namespace accepts no connection in by design (docs/networking.md). The agent's
``tcp.open`` connects to the port on the guest's loopback and relays (guest/tunnel.py), so every
child can serve a port whatever its network, and nothing the guest can reach changes.

What the guest sends is hostile, so it is bounded: at most ``max_per_sandbox`` tunnels per
sandbox (``busy`` past it), and each holds at most ``buffer_bytes`` for a slow reader: that is the
credit window the agent may send ahead (``tcp.ack`` grants more as the reader consumes), so a stalled
client stalls the guest program, never the agent connection its other calls share, and a tunnel
whose guest sends past its window is closed. Bytes to the guest go one ``tcp.send`` at a time, so a
program that does not read slows its client down, never the daemon's memory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient, AgentError
from forkd.runtime.execution import CONTROL_TIMEOUT_S

MAX_PER_SANDBOX = 64
BUFFER_BYTES = 256 * 1024
SEND_CHUNK_BYTES = 256 * 1024  # one tcp.send (base64 in a frame: well under the frame limit)
OPEN_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 60.0  # the agent gives up on a program that stops reading after 30 s


class TunnelsBusy(RuntimeError):
    kind = "busy"


class _Running(Protocol):
    agent: AgentClient


class _Lookup(Protocol):
    def get(self, sandbox_id: str) -> _Running: ...


class Tunnel:
    """One connection to a guest port: :meth:`read` what the program sends, :meth:`write` to it."""

    def __init__(self, agent: AgentClient, buffer_bytes: int, on_close: Callable[[], None] | None = None) -> None:
        self._agent = agent
        self._on_close = on_close
        self._buffer_bytes = buffer_bytes
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._consumed = 0  # read since the last tcp.ack
        self._arrived = asyncio.Event()
        self._started = asyncio.Event()
        self.overrun = False
        self._req_id = 0
        self._result: asyncio.Task[dict[str, Any]] | None = None
        self._controls: set[asyncio.Task[Any]] = set()

    async def open(self, port: int) -> Tunnel:
        """Connect; the agent's ``not_found`` when nothing listens on the port."""
        self._req_id = await self._agent.start(protocol.OP_TCP_OPEN, {"port": port, "window": self._buffer_bytes},
                                               on_event=self._on_event)
        self._result = asyncio.create_task(self._agent.wait(self._req_id, timeout=None))
        self._result.add_done_callback(self._ended)
        started = asyncio.create_task(self._started.wait())
        try:
            await asyncio.wait({started, self._result}, timeout=OPEN_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if not self._started.is_set():
            if self._result.done():
                self._result.result()  # raises why the connect failed
            else:
                raise AgentError(protocol.ERR_TIMEOUT, f"the sandbox did not connect to port {port} within "
                                                       f"{OPEN_TIMEOUT_S:.0f} s")
        return self

    def _ended(self, _: object) -> None:
        self._arrived.set()

    def _on_event(self, name: str, data: dict[str, Any]) -> Any:
        if name == protocol.EVENT_STARTED:
            self._started.set()
            return None
        if name != protocol.EVENT_DATA:
            return None
        chunk = protocol.b64decode(str(data["data_b64"]))
        if self._queued + len(chunk) > self._buffer_bytes:  # past its credit: this guest ignores the protocol
            self.overrun = True
            self.close()
            return None
        self._chunks.append(chunk)
        self._queued += len(chunk)
        self._arrived.set()
        return None

    def _control(self, op: str, **args: Any) -> None:
        """Send a control op without waiting for it (the connection's reader may be busy with us)."""
        async def send() -> None:
            with contextlib.suppress(AgentError):
                if args:
                    await self._agent.call(op, args, timeout=CONTROL_TIMEOUT_S)
                else:
                    await self._agent.control(op, self._req_id, timeout=CONTROL_TIMEOUT_S)
        task = asyncio.create_task(send())
        self._controls.add(task)
        task.add_done_callback(self._controls.discard)

    async def read(self) -> bytes:
        """The next bytes the program sent; ``b""`` once it closed its side (or the tunnel ended)."""
        assert self._result is not None, "open() the tunnel first"
        while not self._chunks:
            if self._result.done():
                return b""
            self._arrived.clear()
            await self._arrived.wait()
        chunk = self._chunks.popleft()
        self._queued -= len(chunk)
        self._consumed += len(chunk)
        if self._consumed >= self._buffer_bytes // 2 and not self._result.done():
            self._control(protocol.OP_TCP_ACK, tunnel=self._req_id, bytes=self._consumed)
            self._consumed = 0
        return chunk

    async def write(self, data: bytes, eof: bool = False) -> None:
        """Send ``data`` (and with ``eof`` then shut the connection's write side), in order."""
        for start in range(0, max(len(data), 1), SEND_CHUNK_BYTES):
            piece = data[start:start + SEND_CHUNK_BYTES]
            last = start + SEND_CHUNK_BYTES >= len(data)
            if piece or (eof and last):
                await self._agent.call(protocol.OP_TCP_SEND, {"tunnel": self._req_id,
                                                              "data_b64": protocol.b64encode(piece),
                                                              "eof": eof and last}, timeout=SEND_TIMEOUT_S)

    def close(self) -> None:
        """End the tunnel: the guest closes the connection. Not a coroutine: called from ``finally``."""
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
        self._chunks.clear()
        self._queued = 0
        if self._result is not None and not self._result.done():
            self._result.cancel()
            self._control(protocol.OP_CANCEL)


class Tunnels:
    """The runtime's tunnels to guest ports, bounded per sandbox."""

    def __init__(self, sandboxes: _Lookup, max_per_sandbox: int = MAX_PER_SANDBOX,
                 buffer_bytes: int = BUFFER_BYTES) -> None:
        self.sandboxes = sandboxes
        self.max_per_sandbox = max_per_sandbox
        self.buffer_bytes = buffer_bytes
        self._open: collections.Counter[str] = collections.Counter()

    async def open(self, sandbox_id: str, port: int) -> Tunnel:
        """A tunnel to ``port`` on the sandbox's loopback; close it when done."""
        if not 1 <= port <= 65535:
            raise ValueError(f"port must be 1-65535, not {port}")
        agent = self.sandboxes.get(sandbox_id).agent
        if self._open[sandbox_id] >= self.max_per_sandbox:
            raise TunnelsBusy(f"sandbox {sandbox_id} has {self.max_per_sandbox} connections to its ports open "
                              "already; close some")
        self._open[sandbox_id] += 1
        tunnel = Tunnel(agent, self.buffer_bytes, on_close=lambda: self._release(sandbox_id))
        try:
            return await tunnel.open(port)
        except BaseException:
            tunnel.close()
            raise

    def _release(self, sandbox_id: str) -> None:
        self._open[sandbox_id] -= 1
        if self._open[sandbox_id] <= 0:
            del self._open[sandbox_id]

    def count(self, sandbox_id: str) -> int:
        return self._open[sandbox_id]
