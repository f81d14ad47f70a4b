"""A command on a terminal through the runtime (what ``exec`` with ``pty``, ``/stdin`` with ``pty`` and ``/resize``
run): the real guest agent as a local process, the runtime's own AgentClient, Sessions and Execution."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import run_bounded
from forkd.guest import protocol
from forkd.runtime.agent_client import AgentClient
from forkd.runtime.results import CommandSpec, Output, Started
from forkd.runtime.sessions import Sessions

BOUND_S = 60.0


@dataclass
class _Record:
    meta: dict[str, Any] = field(default_factory=lambda: {"envs": {"FROM_SANDBOX": "yes"}})


@dataclass
class _Running:
    agent: AgentClient
    record: _Record = field(default_factory=_Record)


class _Lookup:
    def __init__(self, agent: AgentClient) -> None:
        self.running = _Running(agent)

    def get(self, sandbox_id: str) -> _Running:
        return self.running

    async def ended(self, sandbox_id: str, within_s: float = 5.0) -> bool:
        return False


async def _with_agent(body: Any) -> None:
    """The guest agent (python -m forkd.guest.agent) dialling a socket we listen on, as a VM's agent does."""
    directory = Path(tempfile.mkdtemp(prefix="fkp-"))
    connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.get_running_loop().create_future()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set_result((reader, writer))

    server = await asyncio.start_unix_server(accept, path=str(directory / "agent.sock"), limit=protocol.MAX_FRAME_BYTES + 1)
    process = subprocess.Popen([sys.executable, "-m", "forkd.guest.agent", "--transport",
                                f"unix:{directory / 'agent.sock'}"])
    client: AgentClient | None = None
    try:
        client = AgentClient(*await asyncio.wait_for(connected, BOUND_S))
        await body(Sessions(_Lookup(client)))
    finally:
        if client is not None:
            await client.close()
        server.close()
        process.wait(timeout=BOUND_S)  # the agent ends with its connection
        shutil.rmtree(directory, ignore_errors=True)


def test_a_command_on_a_terminal_gets_input_a_size_and_a_resize() -> None:
    async def body(sessions: Sessions) -> None:
        script = "tty >/dev/null && echo on-a-tty; echo env:$FROM_SANDBOX; stty size; read line; echo got:$line; " \
                 "stty size; exit 3"
        execution = await sessions.start_exec("sb-x", CommandSpec(argv=["/bin/sh", "-c", script], pty=(30, 100)))
        output, pid, typed = "", None, False
        async for event in execution:
            if isinstance(event, Started):
                pid = event.pid
            elif isinstance(event, Output):
                assert event.stream == "pty"  # all of it comes from the terminal: no stdout/stderr split
                output += event.text
                if "30 100" in output and not typed:
                    assert pid is not None
                    await sessions.resize("sb-x", pid, 12, 40)
                    await sessions.write_stdin("sb-x", pid, b"hello\n", pty=True)
                    typed = True
        result = Sessions.command_result(execution, await execution.raw_result())
        assert result.exit_code == 3
        assert "on-a-tty" in output and "env:yes" in output  # the sandbox's default envs reach it
        assert "got:hello" in output and "12 40" in output, output

    run_bounded(lambda: _with_agent(body), BOUND_S * 2)


def test_a_terminal_command_takes_no_warm_stdin_or_user() -> None:
    for extra in ({"warm": True}, {"stdin": b"x"}, {"user": "nobody"}):
        with pytest.raises(ValueError, match="pty"):
            CommandSpec(argv=["sh"], pty=(24, 80), **extra)  # type: ignore[arg-type]
