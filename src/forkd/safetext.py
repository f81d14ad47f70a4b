"""Showing text a guest controls: control characters made visible, so it cannot drive a terminal or forge lines.

Guest output, file names and error messages reach CLI error lines, progress lines and the daemon's
log. Raw, an ANSI escape there recolours or rewrites the operator's terminal and a newline forges a
log line; so every C0/C1 control character (and DEL) is shown as a Python-style escape instead.
"""

from __future__ import annotations

import re

from rich.markup import escape

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_AND_NEWLINES = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def visible(text: str, keep_newlines: bool = False) -> str:
    """``text`` with control characters escaped (``\\x1b``); tabs kept, and newlines when ``keep_newlines``."""
    pattern = _CONTROL if keep_newlines else _CONTROL_AND_NEWLINES
    return pattern.sub(lambda m: repr(m.group())[1:-1], text)


def for_rich(text: object) -> str:
    """Text that may come from a guest, for a Rich console: markup shown literally, control characters escaped."""
    return escape(visible(str(text)))
