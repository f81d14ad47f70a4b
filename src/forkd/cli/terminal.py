"""``forkd exec -t`` and ``forkd shell``: a command on a terminal in the guest (the agent's PTY), driven from ours.

Our terminal goes raw while it runs, so keys (^C, arrows, tab) reach the guest's program as typed; what
the program writes comes back as ``pty`` events and goes to our stdout as is; a resize of our window is
passed on (SIGWINCH). Off a terminal (a pipe) stdin is copied through and ends with ^D.
"""

from __future__ import annotations

import base64
import codecs
import contextlib
import os
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from typing import Any

import click

from forkd.sdk.controller import Controller, ForkdError

EOF_KEY = "\x04"  # ^D: what a terminal's end of input is
READ_BYTES = 4096
#: `forkd shell` runs a login shell: bash where the image has it, else sh.
SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"]


def terminal_size() -> tuple[int, int]:
    size = shutil.get_terminal_size((80, 24))
    return size.lines, size.columns


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """Our terminal raw while the guest's program runs (restored however it ends); nothing off a terminal."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _type_in(controller: Controller, sandbox_id: str, pid: int, fd: int) -> None:
    """Copy what is typed (or piped) to the guest's terminal; stops quietly once the program has ended."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # the API carries text
    try:
        while chunk := os.read(fd, READ_BYTES):
            if text := decoder.decode(chunk):
                controller.pty_input(sandbox_id, pid, text)
        controller.pty_input(sandbox_id, pid, EOF_KEY)
    except (ForkdError, OSError):
        return


def _follow_resizes(controller: Controller, sandbox_id: str, pid: int) -> None:
    def resized(_signum: int, _frame: Any) -> None:
        rows, cols = terminal_size()
        threading.Thread(target=lambda: _quietly(controller.pty_resize, sandbox_id, pid, rows, cols),
                         daemon=True).start()  # not in the handler: it interrupts the stream's reads
    signal.signal(signal.SIGWINCH, resized)


def _quietly(call: Any, *args: Any) -> None:
    with contextlib.suppress(ForkdError, OSError):
        call(*args)


def run_on_terminal(controller: Controller, sandbox_id: str, command: str | list[str], env: dict[str, str] | None = None,
                    cwd: str | None = None) -> dict[str, Any]:
    """Run ``command`` on a guest terminal sized like ours, wired to our stdin and stdout; its result."""
    fd = sys.stdin.fileno()
    out = click.get_binary_stream("stdout")
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else command
    rows, cols = terminal_size()
    events = controller.start_pty(sandbox_id, argv, rows=rows, cols=cols, env=env, cwd=cwd)
    with raw_mode(fd):
        for event in events:
            if event.get("event") == "started":
                threading.Thread(target=_type_in, args=(controller, sandbox_id, event["pid"], fd), daemon=True).start()
                _follow_resizes(controller, sandbox_id, event["pid"])
            elif event.get("event") == "pty":
                out.write(base64.b64decode(str(event.get("data_b64", ""))))
                out.flush()
    return events.result  # type: ignore[no-any-return]
