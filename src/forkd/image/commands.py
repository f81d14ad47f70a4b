"""Running the host tools the builder drives, with failures turned into actionable errors.

A raw ``CalledProcessError`` tells a user nothing; a :class:`ToolError` names the tool, quotes the
end of its output and says what to try next.
"""

from __future__ import annotations

import collections
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from forkd.image.errors import ToolError

Command = Sequence[str | Path]

#: Debian package providing each tool, for the "not installed" hint.
_PACKAGE_OF = {
    "apt-get": "apt",
    "apt-cache": "apt",
    "cp": "coreutils",
    "debootstrap": "debootstrap",
    "dpkg-deb": "dpkg",
    "mkfs.ext4": "e2fsprogs",
    "tar": "tar",
    "zstd": "zstd",
}
_TAIL_LINES = 15
# Guest trees get the modes a distribution expects, whatever the daemon's own (private) umask is.
GUEST_UMASK = 0o022


def run(cmd: Command, *, hint: str, cwd: Path | None = None) -> str:
    """Run ``cmd`` to completion and return its stdout; raise :class:`ToolError` with ``hint`` on failure."""
    argv = [str(a) for a in cmd]
    try:
        done = subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True, umask=GUEST_UMASK)
    except FileNotFoundError as exc:
        raise _missing(argv[0]) from exc
    except subprocess.CalledProcessError as exc:
        raise _failed(argv, exc.returncode, (exc.stderr or exc.stdout or "").splitlines(), hint) from exc
    return done.stdout


def stream(cmd: Command, *, hint: str, on_line: Callable[[str], None]) -> None:
    """Run a long ``cmd`` and pass each output line (stdout and stderr merged) to ``on_line`` as it comes."""
    argv = [str(a) for a in cmd]
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                umask=GUEST_UMASK)
    except FileNotFoundError as exc:
        raise _missing(argv[0]) from exc
    with proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)
    if proc.returncode != 0:
        raise _failed(argv, proc.returncode, list(tail), hint)


def _missing(tool: str) -> ToolError:
    package = _PACKAGE_OF.get(tool, tool)
    return ToolError(f"{tool} is not installed: install it with `apt-get install {package}`")


def _failed(argv: list[str], returncode: int, output: list[str], hint: str) -> ToolError:
    tail = "\n".join(f"  | {line}" for line in output[-_TAIL_LINES:])
    return ToolError(f"{argv[0]} failed (exit {returncode}): {hint}\n  $ {' '.join(argv)}\n{tail}".rstrip())
