"""Text a guest controls reaches the CLI and the daemon's log shown, never interpreted."""

from __future__ import annotations

import io
import logging
import sys
from typing import Any

from click.testing import CliRunner

from forkd.daemon.server import VisibleFormatter
from forkd.safetext import for_rich, visible
from forkd.sdk.controller import ForkdError

HOSTILE = "[bold]loud[/bold] [/oops] \x1b[31mred\x1b[0m\nfake: second line"


def test_control_characters_are_escaped_and_tabs_kept() -> None:
    assert visible("a\x1b[2Jb\tc\nd\x9be\x7f") == "a\\x1b[2Jb\tc\\nd\\x9be\\x7f"
    assert visible("one\ntwo", keep_newlines=True) == "one\ntwo"
    assert for_rich("[bold]x[/bold]") == "\\[bold]x\\[/bold]"


def test_cli_error_lines_show_a_guests_markup_and_escapes_literally(monkeypatch) -> None:
    from forkd.cli import execute, main

    class Refusing:
        def start_exec(self, *_: object, **__: object) -> dict:
            raise ForkdError(400, "os_error", HOSTILE)

    monkeypatch.setattr(execute, "daemon", Refusing)
    done = CliRunner().invoke(main.cli, ["exec", "sb-aaaaaaaaaaaa", "--", "true"])
    assert done.exit_code == 125, done.output  # forkd's own failure, as `docker exec` reports one
    assert "[bold]loud[/bold] [/oops] \\x1b[31mred\\x1b[0m\\nfake: second line" in done.output
    assert "\x1b" not in done.output


def test_progress_lines_from_a_guest_are_shown_literally(monkeypatch) -> None:
    from forkd.cli import common

    captured = io.StringIO()
    monkeypatch.setattr(common.err_console, "file", captured)
    with common.progress_display() as show:  # off a terminal: timed lines
        show(HOSTILE)
    shown = captured.getvalue()
    assert "[bold]loud[/bold] [/oops]" in shown and "\x1b[31m" not in shown


def _daemon_log_line(level: int, message: str, *args: object, exc_info: Any = None) -> str:
    """A record as the daemon's formatter writes it."""
    record = logging.LogRecord("forkd.test", level, __file__, 0, message, args, exc_info)
    return VisibleFormatter("%(levelname)s %(message)s").format(record)


def test_daemon_log_lines_cannot_be_forged_or_coloured() -> None:
    logged = _daemon_log_line(logging.WARNING, "sandbox x does not answer (%s)", HOSTILE)
    assert logged == ("WARNING sandbox x does not answer ([bold]loud[/bold] [/oops] \\x1b[31mred\\x1b[0m"
                      "\\nfake: second line)")


def test_a_traceback_carrying_guest_text_cannot_forge_a_record() -> None:
    try:
        raise RuntimeError(f"guest said {HOSTILE}\nINFO forged record")
    except RuntimeError:
        logged = _daemon_log_line(logging.ERROR, "spawning a child failed", exc_info=sys.exc_info())
    first, *traceback = logged.split("\n")
    assert first == "ERROR spawning a child failed"
    assert traceback and all(line.startswith("  ") for line in traceback), traceback
    assert "\x1b" not in logged and "\\x1b[31mred" in logged
