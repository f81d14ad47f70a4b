"""Boundary checks shared by the daemon, the CLI and the store.

Everything a user names (tags, sandbox ids, image names) ends up in a file path, so it is checked
against a strict pattern before it touches the filesystem.
"""

from __future__ import annotations

import re

TAG_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
SANDBOX_ID_PATTERN = r"^sb-[a-z0-9]{12}$"
_TAG_RE = re.compile(TAG_PATTERN)
_SANDBOX_ID_RE = re.compile(SANDBOX_ID_PATTERN)


class ValidationError(ValueError):
    """Input refused at the boundary; the message says what is accepted."""

    kind = "invalid_request"


def check_tag(tag: object, what: str = "tag") -> str:
    """Return ``tag`` if it is a safe name (``[A-Za-z0-9_-]{1,64}``), else raise."""
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
        raise ValidationError(
            f"invalid {what} {tag!r}: use 1-64 characters from A-Z, a-z, 0-9, '_' and '-'"
        )
    return tag


def check_sandbox_id(sandbox_id: object) -> str:
    if not isinstance(sandbox_id, str) or not _SANDBOX_ID_RE.fullmatch(sandbox_id):
        raise ValidationError(f"invalid sandbox id {sandbox_id!r}: expected sb- and 12 letters/digits")
    return sandbox_id


def is_tag(name: str) -> bool:
    return bool(_TAG_RE.fullmatch(name))


def is_sandbox_id(name: str) -> bool:
    return bool(_SANDBOX_ID_RE.fullmatch(name))


def check_range(value: object, what: str, low: int, high: int) -> int:
    """An integer within ``[low, high]`` (bools refused: JSON ``true`` is not a count)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValidationError(f"{what} must be an integer from {low} to {high}, got {value!r}")
    return value
