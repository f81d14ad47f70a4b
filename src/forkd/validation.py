"""Boundary checks shared by the daemon, the CLI and the store.

Everything a user names (tags, sandbox ids, image names) ends up in a file path, so it is checked
against a strict pattern before it touches the filesystem.
"""

from __future__ import annotations

import re
import secrets
import string

TAG_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
# The one spelling of a sandbox id: ``sb-`` and 12 lowercase letters or digits. The 12 characters
# also name the sandbox's host-side network link (host/nftrules.py), which the kernel caps at 15.
SANDBOX_ID_PREFIX = "sb-"
SANDBOX_ID_CHARS = 12
_SANDBOX_ID_ALPHABET = string.ascii_lowercase + string.digits
_SANDBOX_ID_BODY = rf"{SANDBOX_ID_PREFIX}[a-z0-9]{{{SANDBOX_ID_CHARS}}}"
SANDBOX_ID_PATTERN = rf"^{_SANDBOX_ID_BODY}$"
_TAG_RE = re.compile(TAG_PATTERN)
_SANDBOX_ID_RE = re.compile(SANDBOX_ID_PATTERN)
_SANDBOX_ID_IN_TEXT = re.compile(rf"\b{_SANDBOX_ID_BODY}\b")


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


def new_sandbox_id() -> str:
    return SANDBOX_ID_PREFIX + "".join(secrets.choice(_SANDBOX_ID_ALPHABET) for _ in range(SANDBOX_ID_CHARS))


def find_sandbox_id(text: str) -> str | None:
    """The first sandbox id in ``text`` (a request path, say), if any."""
    found = _SANDBOX_ID_IN_TEXT.search(text)
    return found.group(0) if found else None


def is_tag(name: str) -> bool:
    return bool(_TAG_RE.fullmatch(name))


def is_sandbox_id(name: str) -> bool:
    return bool(_SANDBOX_ID_RE.fullmatch(name))


def check_range(value: object, what: str, low: int, high: int) -> int:
    """An integer within ``[low, high]`` (bools refused: JSON ``true`` is not a count)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValidationError(f"{what} must be an integer from {low} to {high}, got {value!r}")
    return value
