"""The forkd guest agent as it is installed into an image.

The sources of ``forkd.guest`` (stdlib-only) are copied in as the top-level package ``forkd_guest``
under ``/opt/forkd``, and ``/sbin/forkd-init`` starts it as PID 1 with the guest's own Python. The
agent's files are part of the image key, so editing the agent rebuilds the image.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import forkd.guest
from forkd.guest.protocol import AGENT_VERSION
from forkd.image.errors import SourceError
from forkd.image.tree import resolve_in_root, write_in_root

GUEST_INIT = "/sbin/forkd-init"
AGENT_DIR = "/opt/forkd"
AGENT_PACKAGE = "forkd_guest"
#: Where a Python interpreter is looked for in the guest root, in order (Debian, then python:* images).
PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")
_SHELL = "/bin/sh"


@dataclass(frozen=True)
class AgentPayload:
    """The agent's source files (path inside the package, content) and its version string."""

    files: tuple[tuple[str, bytes], ...]
    version: str

    def digest(self) -> str:
        """SHA-256 over the files' names and contents."""
        h = hashlib.sha256()
        for name, content in self.files:
            h.update(f"{name}\0{len(content)}\0".encode())
            h.update(content)
        return h.hexdigest()


def current_agent() -> AgentPayload:
    """The agent of this forkd installation, read from the ``forkd.guest`` package."""
    package_dir = Path(forkd.guest.__file__).parent
    sources = sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)
    files = tuple((p.relative_to(package_dir).as_posix(), p.read_bytes()) for p in sources)
    return AgentPayload(files=files, version=AGENT_VERSION)


def install_agent(root: Path, agent: AgentPayload) -> None:
    """Copy the agent into ``root`` and write ``/sbin/forkd-init`` to start it with the root's Python."""
    python = find_python(root)
    if not _is_executable(root, _SHELL):
        raise SourceError(f"the root tree has no {_SHELL}, which starts the forkd agent: use an image with a shell")
    for name, content in agent.files:
        write_in_root(root, f"{AGENT_DIR}/{AGENT_PACKAGE}/{name}", content)
    write_in_root(root, GUEST_INIT, init_script(python).encode(), mode=0o755)


def find_python(root: Path) -> str:
    """Guest path of the first executable Python 3 among :data:`PYTHON_CANDIDATES`."""
    for candidate in PYTHON_CANDIDATES:
        if _is_executable(root, candidate):
            return candidate
    raise SourceError(
        f"the root tree has no executable python3 (looked for {', '.join(PYTHON_CANDIDATES)}): the forkd agent "
        f"needs python3 in the image; add python3 to the packages or use a Python base image"
    )


def init_script(python: str) -> str:
    """The guest's ``/sbin/forkd-init``: the agent's ``init`` module as PID 1."""
    return (
        "#!/bin/sh\n"
        "# Written by the forkd image builder: PID 1 of the guest is the forkd agent.\n"
        f"PYTHONPATH={AGENT_DIR} exec {python} -m {AGENT_PACKAGE}.init \"$@\"\n"
    )


def _is_executable(root: Path, path: str) -> bool:
    target = resolve_in_root(root, path)
    return target.is_file() and os.access(target, os.X_OK)
