"""What request bodies promise in their JSON Schema beyond their fields, said the way tools read it: integers as
JSON Schema counts them (1.0 is one), and rules between fields (exactly one of two) with ``not``.

The models in schemas.py check the same rules in their validators; these keep the document honest about them,
so a request the schema admits is not refused (tests/unit/test_openapi.py fuzzes exactly that).
"""

from __future__ import annotations

import types
import typing
from typing import Annotated

from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, Strict, ValidationInfo, field_validator

_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
CIDR_PATTERN = rf"^{_OCTET}(\.{_OCTET}){{3}}/(3[0-2]|[12]?[0-9])$"  # an IPv4 network as the API parses it
PORT_RANGE_PATTERN = rf"^{_PORT}(-{_PORT})?$"  # 1-65535, or LOW-HIGH of those


def integral(value: object) -> object:
    """JSON has one number type, and JSON Schema counts 1.0 as an integer: take it as 1 (1.5, true, "1" stay refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def takes_int(annotation: object) -> bool:
    """``int``, ``StrictInt`` or an optional one (not a float field: 1.0 stays a float there)."""
    if typing.get_origin(annotation) is Annotated:
        return takes_int(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(takes_int(arg) for arg in typing.get_args(annotation))
    return annotation is int


def present(name: str, value: object = None) -> dict[str, object]:
    """``name`` is given, not null (and, with ``value``, equal to it)."""
    schema: dict[str, object] = {"const": value} if value is not None else {"not": {"type": "null"}}
    return {"required": [name], "properties": {name: schema}}


def both(first: str, second: str) -> dict[str, object]:
    return {"allOf": [present(first), present(second)]}


def refused(*cases: dict[str, object]) -> dict[str, object]:
    """Bodies matching any of ``cases`` are refused by the model's validator; said with ``not``, which client
    generators skip (a top-level ``oneOf`` would make them drop the body's other fields)."""
    return {"not": {"anyOf": list(cases)}}


def exactly_one_of(first: str, second: str, *more: dict[str, object]) -> dict[str, object]:
    """A body that must give exactly one of ``first`` and ``second`` (non-null), and match none of ``more``."""
    neither: dict[str, object] = {"properties": {first: {"type": "null"}, second: {"type": "null"}}}  # both absent
    return refused(both(first, second), neither, *more)


#: A port number in a list of ports or ranges (the constraints before the validator, so the schema shows them).
Port = Annotated[int, Strict(), Ge(1), Le(65535), BeforeValidator(integral)]


class JsonIntegers(BaseModel):
    """A body whose integer fields (StrictInt: no booleans, no strings) take 1.0, as the document's "integer" admits."""

    @field_validator("*", mode="before")
    @classmethod
    def _integral_numbers(cls, value: object, info: ValidationInfo) -> object:
        return integral(value) if takes_int(cls.model_fields[info.field_name or ""].annotation) else value


def _is(name: str, value: object) -> dict[str, object]:
    return {"required": [name], "properties": {name: {"const": value}}}


_TAKEN = {"not": {"type": "null"}}
#: An allow-list only means something under default deny.
EGRESS_RULES = {"if": {"required": ["allow"], "properties": {"allow": {"minItems": 1}}}, "then": present("default", "deny")}
#: One snapshot (tag or digest); a keyed fork is answered once (no stream); egress needs nat.
FORK_RULES = {**exactly_one_of("snapshot_tag", "snapshot_digest", {"allOf": [present("idempotency_key"), _is("stream", True)]}),
              "if": present("egress"), "then": present("net", "nat")}
#: A command (cmd or argv); a warm cmd has a word in it.
EXEC_RULES = {**exactly_one_of("cmd", "argv"),
              "if": {"required": ["warm", "cmd"], "properties": {"warm": {"const": True}, "cmd": {"type": "string"}}},
              "then": {"properties": {"cmd": {"pattern": r"\S"}}}}
#: A pull names a URL or an index entry (its name, not a SHA-256: the index advertises it).
PULL_RULES = exactly_one_of("url", "index", both("index", "sha256"),
                            {**present("index"), "properties": {"index": _TAKEN, "name": {"type": "null"}}})
