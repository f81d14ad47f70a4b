"""``sandbox.commands``: shell commands in a sandbox, in the foreground or the background (E2B's shape).

``Commands``/``CommandHandle`` for ``Sandbox``, ``AsyncCommands``/``AsyncCommandHandle`` for ``AsyncSandbox``;
what a command's events and answer mean is read by the module's functions, once for both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from forkd.sdk.async_controller import AsyncEventStream, maybe_await
from forkd.sdk.controller import EventStream
from forkd.sdk.errors import ForkdError, NotFoundException, TimeoutException
from forkd.sdk.models import CommandExitException, CommandResult, ProcessInfo
from forkd.sdk.ref import AsyncSandboxRef, SandboxRef


def _started_pid(first: dict[str, Any] | None, result: Any) -> int:
    if first is None or first.get("event") != "started":
        raise ForkdError(500, "no_start", f"the command did not report a start: {first or result}")
    return int(first["pid"])


def _output(event: dict[str, Any]) -> tuple[str | None, str | None, None] | None:
    """An output event as E2B's ``(stdout, stderr, pty)`` piece; None for other events."""
    name, data = event.get("event"), event.get("data", "")
    if name == "stdout":
        return data, None, None
    if name == "stderr":
        return None, data, None
    return None


def _result(pid: int, stdout: list[str], stderr: list[str], outcome: dict[str, Any] | None) -> CommandResult:
    """The finished command's result; raises if it timed out or exited non-zero."""
    outcome = outcome or {}
    if outcome.get("timed_out"):
        raise TimeoutException(504, "timeout", f"command {pid} ran past its timeout and was killed")
    result = CommandResult(stdout="".join(stdout), stderr="".join(stderr), exit_code=outcome.get("exit_code", -1),
                           error=f"killed by signal {outcome['signal']}" if outcome.get("signal") else None,
                           truncated=bool(outcome.get("truncated")))
    if result.exit_code != 0:
        raise CommandExitException(result)
    return result


def _exec_options(cmd: str, envs: dict[str, str] | None, user: str | None, cwd: str | None,
                  stdin: bool | str | None, timeout: float | None, warm: bool) -> dict[str, Any]:
    """``start_exec``'s arguments for E2B's ``commands.run`` ones (``timeout=0``: none; ``stdin=True``: open)."""
    return {"cmd": cmd, "env": envs, "cwd": cwd, "user": user, "timeout_s": timeout or None,
            "stdin": None if stdin is True else (stdin or ""), "warm": warm}


def _process(entry: dict[str, Any]) -> ProcessInfo:
    return ProcessInfo(pid=entry["pid"], cmd=entry.get("shell") or " ".join(entry.get("argv", [])),
                       args=list(entry.get("argv", [])), running=entry["running"], exit_code=entry["exit_code"],
                       started_at=entry.get("started_at"))


class CommandHandle:
    """A command started in the background: its ``pid``, ``wait()``, ``kill()``, ``send_stdin()``."""

    def __init__(self, sandbox: SandboxRef, events: EventStream) -> None:
        self._sandbox = sandbox
        self._events = events
        self._iterator = iter(events)
        try:
            self.pid = _started_pid(next(self._iterator, None), events.result)
        except ForkdError:
            events.close()
            raise
        self._stdout: list[str] = []
        self._stderr: list[str] = []

    def __iter__(self) -> Iterator[tuple[str | None, str | None, None]]:
        """``(stdout, stderr, pty)`` pieces as they arrive, one set, as E2B's handle yields them."""
        for event in self._iterator:
            if (piece := _output(event)) is not None:
                self._stdout.append(piece[0] or "")
                self._stderr.append(piece[1] or "")
                yield piece

    def wait(self, on_stdout: Callable[[str], Any] | None = None,
             on_stderr: Callable[[str], Any] | None = None) -> CommandResult:
        """Block until the command ends; raises ``CommandExitException`` if it exits non-zero."""
        for stdout, stderr, _ in self:
            if stdout is not None and on_stdout is not None:
                on_stdout(stdout)
            if stderr is not None and on_stderr is not None:
                on_stderr(stderr)
        return _result(self.pid, self._stdout, self._stderr, self._events.result)

    def kill(self) -> bool:
        """SIGKILL the command's process group; ``False`` if it had already ended."""
        return self._sandbox.commands.kill(self.pid)

    def send_stdin(self, data: str) -> None:
        self._sandbox.commands.send_stdin(self.pid, data)

    def disconnect(self) -> None:
        """Stop reading its output; the command keeps running (kill it with ``commands.kill(pid)``)."""
        self._events.close()


class Commands:
    """``sandbox.commands``: run shell commands (``/bin/sh -c``) in the sandbox."""

    def __init__(self, sandbox: SandboxRef) -> None:
        self._sandbox = sandbox

    def run(self, cmd: str, background: bool | None = None, envs: dict[str, str] | None = None,
            user: str | None = None, cwd: str | None = None, on_stdout: Callable[[str], Any] | None = None,
            on_stderr: Callable[[str], Any] | None = None, stdin: bool | str | None = None,
            timeout: float | None = 60, request_timeout: float | None = None,
            warm: bool = False) -> CommandResult | CommandHandle:
        """Run ``cmd``; wait and return a ``CommandResult``, or with ``background=True`` a ``CommandHandle``.

        ``stdin=True`` keeps stdin open for ``send_stdin``; a string is written to stdin, which is then
        closed; by default stdin is empty. ``timeout`` (seconds, 0 = none) kills the command's process group.
        ``warm=True`` (forkd): ``cmd`` is a ``python3 ...`` command line, run as a fork of the snapshot's
        warm interpreter so its imports are already done (see docs/guest-protocol.md for the differences).
        """
        del request_timeout  # requests are bounded by the command's own timeout
        handle = CommandHandle(self._sandbox, self._sandbox.api.start_exec(
            self._sandbox.sandbox_id, **_exec_options(cmd, envs, user, cwd, stdin, timeout, warm)))
        if background:
            return handle
        return handle.wait(on_stdout=on_stdout, on_stderr=on_stderr)

    def kill(self, pid: int) -> bool:
        try:
            self._sandbox.api.signal_process(self._sandbox.sandbox_id, pid, 9)
        except NotFoundException:
            return False
        return True

    def send_stdin(self, pid: int, data: str) -> None:
        self._sandbox.api.send_stdin(self._sandbox.sandbox_id, pid, data)

    def close_stdin(self, pid: int) -> None:
        self._sandbox.api.send_stdin(self._sandbox.sandbox_id, pid, "", eof=True)

    def list(self) -> list[ProcessInfo]:
        """Running commands and the last finished ones."""
        return [_process(p) for p in self._sandbox.api.processes(self._sandbox.sandbox_id)]


class AsyncCommandHandle:
    """``CommandHandle`` for asyncio: ``await handle.wait()``, ``async for`` its output pieces."""

    def __init__(self, sandbox: AsyncSandboxRef, events: AsyncEventStream, pid: int,
                 iterator: AsyncIterator[dict[str, Any]]) -> None:
        self._sandbox = sandbox
        self._events = events
        self._iterator = iterator
        self.pid = pid
        self._stdout: list[str] = []
        self._stderr: list[str] = []

    @classmethod
    async def start(cls, sandbox: AsyncSandboxRef, events: AsyncEventStream) -> AsyncCommandHandle:
        iterator = aiter(events)
        try:
            pid = _started_pid(await anext(iterator, None), events.result)
        except ForkdError:
            await events.close()
            raise
        return cls(sandbox, events, pid, iterator)

    async def __aiter__(self) -> AsyncIterator[tuple[str | None, str | None, None]]:
        async for event in self._iterator:
            if (piece := _output(event)) is not None:
                self._stdout.append(piece[0] or "")
                self._stderr.append(piece[1] or "")
                yield piece

    async def wait(self, on_stdout: Callable[[str], Any] | None = None,
                   on_stderr: Callable[[str], Any] | None = None) -> CommandResult:
        """Until the command ends; callbacks may be coroutine functions."""
        async for stdout, stderr, _ in self:
            if stdout is not None and on_stdout is not None:
                await maybe_await(on_stdout(stdout))
            if stderr is not None and on_stderr is not None:
                await maybe_await(on_stderr(stderr))
        return _result(self.pid, self._stdout, self._stderr, self._events.result)

    async def kill(self) -> bool:
        return await self._sandbox.commands.kill(self.pid)

    async def send_stdin(self, data: str) -> None:
        await self._sandbox.commands.send_stdin(self.pid, data)

    async def disconnect(self) -> None:
        await self._events.close()


class AsyncCommands:
    """``AsyncSandbox.commands``: the methods of ``Commands`` as coroutines."""

    def __init__(self, sandbox: AsyncSandboxRef) -> None:
        self._sandbox = sandbox

    async def run(self, cmd: str, background: bool | None = None, envs: dict[str, str] | None = None,
                  user: str | None = None, cwd: str | None = None, on_stdout: Callable[[str], Any] | None = None,
                  on_stderr: Callable[[str], Any] | None = None, stdin: bool | str | None = None,
                  timeout: float | None = 60, request_timeout: float | None = None,
                  warm: bool = False) -> CommandResult | AsyncCommandHandle:
        """As ``Commands.run``; ``on_stdout``/``on_stderr`` may be coroutine functions."""
        del request_timeout
        events = await self._sandbox.api.start_exec(self._sandbox.sandbox_id,
                                                    **_exec_options(cmd, envs, user, cwd, stdin, timeout, warm))
        handle = await AsyncCommandHandle.start(self._sandbox, events)
        if background:
            return handle
        return await handle.wait(on_stdout=on_stdout, on_stderr=on_stderr)

    async def kill(self, pid: int) -> bool:
        try:
            await self._sandbox.api.signal_process(self._sandbox.sandbox_id, pid, 9)
        except NotFoundException:
            return False
        return True

    async def send_stdin(self, pid: int, data: str) -> None:
        await self._sandbox.api.send_stdin(self._sandbox.sandbox_id, pid, data)

    async def close_stdin(self, pid: int) -> None:
        await self._sandbox.api.send_stdin(self._sandbox.sandbox_id, pid, "", eof=True)

    async def list(self) -> list[ProcessInfo]:
        return [_process(p) for p in await self._sandbox.api.processes(self._sandbox.sandbox_id)]
