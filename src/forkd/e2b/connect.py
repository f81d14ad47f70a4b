"""The Connect protocol with its JSON codec, as E2B's SDKs speak it to envd.

Unary calls post ``application/json`` and get JSON back (errors: a Connect status and
``{"code", "message"}``). Streaming calls use ``application/connect+json``: every message is an
envelope of one flags byte, a 4-byte big-endian length and the JSON; a server stream ends with an
envelope flagged end-of-stream holding ``{}`` or ``{"error": ...}``, and always answers HTTP 200.
Everything a client sends is bounded: an envelope over ``MAX_MESSAGE_BYTES`` or a malformed one is
refused with a Connect error, never buffered.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from typing import Any

from forkd.e2b.errors import ConnectError

UNARY_TYPE = "application/json"
STREAM_TYPE = "application/connect+json"
FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
MAX_MESSAGE_BYTES = 8 << 20  # the largest input message (SendInput data) a client may send
MAX_DEPTH = 32  # nesting of objects and lists in a message; envd's messages need 4
_HEADER = struct.Struct(">BI")


def decode_message(data: bytes) -> dict[str, Any]:
    """One JSON message: an object nested at most ``MAX_DEPTH`` deep, else ``invalid_argument``."""
    try:
        message = json.loads(data or b"{}")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConnectError("invalid_argument", f"the message is not valid JSON: {exc}") from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise ConnectError("invalid_argument", f"the message nests over {MAX_DEPTH} levels deep") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "a message must be a JSON object")
    if _depth(message) > MAX_DEPTH:
        raise ConnectError("invalid_argument", f"the message nests over {MAX_DEPTH} levels deep")
    return message


def _depth(value: Any) -> int:
    """How deep objects and lists nest in ``value`` (without recursion: the value is the client's)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        current, depth = pending.pop()
        if isinstance(current, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:  # deeper is refused anyway: stop walking
                children = current.values() if isinstance(current, dict) else current
                pending.extend((child, depth + 1) for child in children)
    return deepest


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(payload)) + payload


def end_stream(error: ConnectError | None = None) -> bytes:
    return envelope({"error": error.body()} if error is not None else {}, FLAG_END_STREAM)


async def read_unary(chunks: AsyncIterator[bytes], limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """A unary request body, refused once it grows past ``limit``."""
    body = bytearray()
    async for chunk in chunks:
        body.extend(chunk)
        if len(body) > limit:
            raise ConnectError("resource_exhausted", f"the request message is over {limit} bytes")
    return decode_message(bytes(body))


async def read_envelopes(chunks: AsyncIterator[bytes], limit: int = MAX_MESSAGE_BYTES) -> AsyncIterator[dict[str, Any]]:
    """The messages of an enveloped request body, in order, until end-of-stream or the body ends."""
    buffer = bytearray()
    async for chunk in chunks:
        buffer.extend(chunk)
        while len(buffer) >= _HEADER.size:
            flags, length = _HEADER.unpack_from(buffer)
            if length > limit:
                raise ConnectError("resource_exhausted", f"an envelope of {length} bytes is over the {limit} limit")
            if flags & ~(FLAG_COMPRESSED | FLAG_END_STREAM):
                raise ConnectError("invalid_argument", f"unknown envelope flags 0x{flags:02x}")
            if flags & FLAG_COMPRESSED:
                raise ConnectError("unimplemented", "compressed messages are not accepted; send them uncompressed")
            if len(buffer) < _HEADER.size + length:
                break
            payload = bytes(buffer[_HEADER.size:_HEADER.size + length])
            del buffer[:_HEADER.size + length]
            if flags & FLAG_END_STREAM:
                return
            yield decode_message(payload)
    if buffer:
        raise ConnectError("invalid_argument", f"the request ended inside an envelope ({len(buffer)} stray bytes)")
