"""The forkd guest wire protocol, shared by the in-guest agent and the host.

Stdlib only: this module is copied into guest images next to the agent.

Framing is one JSON object per line (UTF-8, ``\\n`` terminated) in both directions over one
byte stream (a virtio-serial port in QEMU, vsock later). Many requests may be in flight on one
connection; every frame carries the ``id`` of the request it belongs to.

Request::

    {"id": 7, "op": "exec", "args": {...}}

Zero or more event frames, then exactly one terminal frame::

    {"id": 7, "event": "stdout", "data": {"data_b64": "..."}}
    {"id": 7, "ok": true, "result": {...}}
    {"id": 7, "ok": false, "error": {"code": "timeout", "message": "..."}}

Binary payloads travel base64-encoded in fields whose names end in ``_b64``.

A request may carry ``"trace": true``; its terminal frame then carries ``"trace": [[stage, ns], ...]``,
the guest's CLOCK_MONOTONIC at the end of each stage it passed (read, decoded, started, ...; see
docs/guest-protocol.md). Agents before this ignore the key and answer without one.
"""

from __future__ import annotations

import base64
import json
from typing import Any

PROTOCOL_VERSION = 1

#: The agent's version, recorded in snapshots and images. It lives here, not in the agent, so
#: host code never imports the agent. 0.2: the guest has eth0 (snapshots without a NIC cannot load).
AGENT_VERSION = "0.2.0"

#: Name of the virtio-serial port the agent listens on (``/sys/class/virtio-ports/*/name``).
AGENT_PORT_NAME = "org.forkd.agent"

#: Largest frame either side accepts; bigger file transfers are chunked by the caller.
MAX_FRAME_BYTES = 16 * 1024 * 1024

#: Largest chunk of file data carried by one files.read / files.write request.
FILE_CHUNK_BYTES = 4 * 1024 * 1024

#: Largest single read from a frame stream. Bigger costs more than it saves in a TCG guest: the
#: buffer of every read is allocated and faulted in (a 1 MiB read cost ~2.5 ms per frame there).
READ_CHUNK_BYTES = 64 * 1024

# Operations the agent implements. The argument and result shapes are documented in
# docs/guest-protocol.md; the names are the contract.
OP_PING = "ping"
OP_RESEED = "reseed"
#: In a cell the agent sends a context: the seed it is owed, applied before the cell runs (guest-internal).
CELL_RESEED = "reseed_entropy_b64"
#: The context a cell runs in when it names none.
DEFAULT_CONTEXT = "default"
OP_WARM = "warm"
OP_EXEC = "exec"
OP_PROC_KILL = "proc.kill"
OP_PROC_STDIN = "proc.stdin"
OP_PROC_LIST = "proc.list"
OP_RUN_CODE = "run_code"
OP_EVAL = "eval"
OP_FILES_READ = "files.read"
OP_FILES_WRITE = "files.write"
OP_FILES_LIST = "files.list"
OP_FILES_STAT = "files.stat"
OP_FILES_REMOVE = "files.remove"
OP_FILES_MKDIR = "files.mkdir"
OP_FILES_RENAME = "files.rename"
OP_CONTEXTS_CREATE = "contexts.create"
OP_CONTEXTS_LIST = "contexts.list"
OP_CONTEXTS_RESTART = "contexts.restart"
OP_CONTEXTS_DELETE = "contexts.delete"
OP_WATCH_CREATE = "watch.create"
OP_WATCH_READ = "watch.read"
OP_WATCH_REMOVE = "watch.remove"
OP_PTY_START = "pty.start"
OP_PTY_INPUT = "pty.input"
OP_PTY_RESIZE = "pty.resize"
OP_PTY_KILL = "pty.kill"
OP_ACTIVITY = "activity"  # what keeps the guest busy (user processes, watches): may the host stop it?
OP_CLOCK_SET = "clock.set"  # set the guest's wall clock (a guest the host stopped and continued lags)
OP_TCP_OPEN = "tcp.open"  # a byte tunnel to a TCP port a guest program listens on (guest/tunnel.py)
OP_TCP_SEND = "tcp.send"
OP_TCP_ACK = "tcp.ack"

# Control ops about another request in flight (``args: {"id": <its id>}``). An agent that does not
# know them answers ``unknown_op``; the host then falls back (see runtime/agent_client.py).
OP_FLOW_PAUSE = "flow.pause"  # stop reading that request's process pipes (the process blocks on write)
OP_FLOW_RESUME = "flow.resume"  # read them again
OP_CANCEL = "cancel"  # end that request: kill its process group / interrupt its cell

ALL_OPS = frozenset(
    {
        OP_PING,
        OP_ACTIVITY,
        OP_CLOCK_SET,
        OP_RESEED,
        OP_WARM,
        OP_EXEC,
        OP_PROC_KILL,
        OP_PROC_STDIN,
        OP_PROC_LIST,
        OP_RUN_CODE,
        OP_EVAL,
        OP_FILES_READ,
        OP_FILES_WRITE,
        OP_FILES_LIST,
        OP_FILES_STAT,
        OP_FILES_REMOVE,
        OP_FILES_MKDIR,
        OP_FILES_RENAME,
        OP_CONTEXTS_CREATE,
        OP_CONTEXTS_LIST,
        OP_CONTEXTS_RESTART,
        OP_CONTEXTS_DELETE,
        OP_FLOW_PAUSE,
        OP_FLOW_RESUME,
        OP_CANCEL,
        OP_WATCH_CREATE,
        OP_WATCH_READ,
        OP_WATCH_REMOVE,
        OP_PTY_START,
        OP_PTY_INPUT,
        OP_PTY_RESIZE,
        OP_PTY_KILL,
        OP_TCP_OPEN,
        OP_TCP_SEND,
        OP_TCP_ACK,
    }
)

#: The envelope key of a request's trace ask (``true``) and of its answer's marks (``[[stage, ns], ...]``).
TRACE = "trace"
#: Most marks an answer's trace may carry; a host drops a trace that breaks this or the shape.
MAX_TRACE_MARKS = 16


def traced(frame: dict[str, Any]) -> bool:
    """True when a request asks for its answer's trace."""
    return frame.get(TRACE) is True


def trace_marks(frame: dict[str, Any]) -> list[tuple[str, int]] | None:
    """The ``(stage, ns)`` marks of an answer's trace, None if it has none or one of the wrong shape."""
    marks = frame.get(TRACE)
    if not isinstance(marks, list) or len(marks) > MAX_TRACE_MARKS:
        return None
    checked = []
    for mark in marks:
        if not (isinstance(mark, list) and len(mark) == 2 and isinstance(mark[0], str) and len(mark[0]) <= 32
                and isinstance(mark[1], int) and not isinstance(mark[1], bool)):
            return None
        checked.append((mark[0], mark[1]))
    return checked


# Event names streamed before a terminal frame.
EVENT_STARTED = "started"  # exec: {"pid": int}
EVENT_STDOUT = "stdout"  # exec: {"data_b64": str}; run_code: {"text": str}
EVENT_STDERR = "stderr"  # same shapes as stdout
EVENT_DATA = "data"  # tcp.open: {"data_b64": str}, what the guest program sent on the connection
EVENT_PTY = "pty"  # pty.start: {"data_b64": str}, what the program wrote to its terminal
EVENT_RESULT = "result"  # run_code: one rich result (display() or the cell's value), E2B's Result keys

#: The error name of a run_code/eval result whose interpreter process died (a signal, OOM kill).
INTERPRETER_CRASHED = "InterpreterCrashed"

# Error codes in terminal error frames.
ERR_BAD_REQUEST = "bad_request"
ERR_UNKNOWN_OP = "unknown_op"
ERR_NOT_FOUND = "not_found"
ERR_TIMEOUT = "timeout"
ERR_OS = "os_error"
ERR_INTERNAL = "internal"


class OutputBudget:
    """An ``output_limit``: how much output a request may still forward (None: unlimited)."""

    def __init__(self, limit: int | None) -> None:
        self.left = limit
        self.truncated = False

    def clip(self, data: Any) -> Any:
        """The part of ``data`` (bytes or text) within the budget; what is cut marks ``truncated``."""
        if self.left is not None:
            if len(data) > self.left:
                data = data[: self.left]
                self.truncated = True
            self.left -= len(data)
        return data


class ProtocolError(ValueError):
    """A frame that cannot be parsed or does not have the protocol's shape."""


class FrameTooDeep(ProtocolError):
    """A frame nested past what the parser survives: hostile, never a line torn by a restore."""


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise ProtocolError(f"invalid base64 payload: {exc}") from None


# Made once: json.dumps/json.loads with arguments build a new coder per call, which costs a TCG
# guest more than the coding itself. Both are stateless, so every thread may share them.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_DECODER = json.JSONDecoder()


def encode_frame(frame: dict[str, Any]) -> bytes:
    """Serialise one frame to a single ``\\n``-terminated line."""
    line = _ENCODER.encode(frame).encode("utf-8") + b"\n"
    if len(line) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(line)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return line


def decode_frame(line: bytes) -> dict[str, Any]:
    """Parse one line into a frame dict, raising :class:`ProtocolError` on anything else."""
    if len(line) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(line)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        text = line.decode("utf-8").strip(" \t\n\r")  # what JSON calls whitespace
        frame, end = _DECODER.raw_decode(text)
        if end != len(text):
            raise ValueError(f"extra data after the JSON value at {end}")
    except RecursionError:  # [[[[...: valid JSON no honest peer sends
        raise FrameTooDeep("frame nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    if not isinstance(frame, dict):
        raise ProtocolError("frame must be a JSON object")
    return frame


def request(req_id: int, op: str, args: dict[str, Any] | None = None, *, trace: bool = False) -> dict[str, Any]:
    frame: dict[str, Any] = {"id": req_id, "op": op, "args": args or {}}
    if trace:
        frame[TRACE] = True
    return frame


def event(req_id: Any, name: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"id": req_id, "event": name, "data": data}


def ok(req_id: Any, result: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": req_id, "ok": True, "result": result or {}}


def error(req_id: Any, code: str, message: str, **details: Any) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    err.update(details)
    return {"id": req_id, "ok": False, "error": err}


def parse_request(frame: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:
    """Validate a request frame's envelope and return ``(id, op, args)``."""
    req_id = frame.get("id")
    if not isinstance(req_id, int) or isinstance(req_id, bool):
        raise ProtocolError("request needs an integer 'id'")
    op = frame.get("op")
    if not isinstance(op, str):
        raise ProtocolError("request needs a string 'op'")
    args = frame.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError("'args' must be a JSON object")
    return req_id, op, args


def is_terminal(frame: dict[str, Any]) -> bool:
    """True for the frame that ends a request (``ok`` present), False for events."""
    return "ok" in frame
