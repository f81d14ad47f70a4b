"""``sandbox.commands``, written once: shell commands in the foreground or the background (E2B's shape).

The flavours (``sandbox_sync/commands.py``, ``sandbox_async/commands.py``) add only how to iterate a
handle's output (``for`` or ``async for``); see ``flavour.py`` for how one method serves both.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

from forkd.sdk.errors import ForkdError, TimeoutException
from forkd.sdk.models import CommandExitException, CommandResult, ProcessInfo
from forkd.sdk.sandbox.flavour import Flavour, SandboxRef, Steps, found, operation

Piece = tuple[str | None, str | None, None]  # E2B's (stdout, stderr, pty)


def _started_pid(first: dict[str, Any] | None, result: Any) -> int:
    if first is None or first.get("event") != "started":
        raise ForkdError(500, "no_start", f"the command did not report a start: {first or result}")
    return int(first["pid"])


def _output(event: dict[str, Any]) -> Piece | None:
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


class CommandHandleCore:
    """A command started in the background: its ``pid``, ``wait()``, ``kill()``, ``send_stdin()``."""

    _flavour: Flavour

    def __init__(self, sandbox: SandboxRef, events: Any, pid: int, iterator: Any) -> None:
        self._sandbox = sandbox
        self._events = events
        self._iterator = iterator
        self.pid = pid
        self._stdout: list[str] = []
        self._stderr: list[str] = []

    @classmethod
    def start(cls, sandbox: SandboxRef, events: Any) -> Steps[Any]:
        """Steps: the handle once the command reported its start (the stream is closed if it did not)."""
        iterator = cls._flavour.iterate(events)
        try:
            pid = _started_pid((yield cls._flavour.next(iterator)), events.result)
        except ForkdError:
            yield events.close()
            raise
        return cls(sandbox, events, pid, iterator)

    def _take(self, event: dict[str, Any]) -> Piece | None:
        """The output piece an event carries, kept for the result; None for other events."""
        if (piece := _output(event)) is not None:
            self._stdout.append(piece[0] or "")
            self._stderr.append(piece[1] or "")
        return piece

    @operation
    def wait(self, on_stdout: Callable[[str], Any] | None = None,
             on_stderr: Callable[[str], Any] | None = None) -> Steps[CommandResult]:
        """Until the command ends; raises ``CommandExitException`` if it exits non-zero. The async
        flavour's callbacks may be coroutine functions."""
        while (event := (yield self._flavour.next(self._iterator))) is not None:
            if (piece := self._take(event)) is None:
                continue
            stdout, stderr, _ = piece
            if stdout is not None and on_stdout is not None:
                yield on_stdout(stdout)
            if stderr is not None and on_stderr is not None:
                yield on_stderr(stderr)
        return _result(self.pid, self._stdout, self._stderr, self._events.result)

    def kill(self) -> Any:
        """SIGKILL the command's process group; ``False`` if it had already ended."""
        return self._sandbox.commands.kill(self.pid)

    def send_stdin(self, data: str) -> Any:
        """Write ``data`` to the command's stdin (started with ``stdin=True``)."""
        return self._sandbox.commands.send_stdin(self.pid, data)

    def disconnect(self) -> Any:
        """Stop reading its output; the command keeps running (kill it with ``commands.kill(pid)``)."""
        return self._events.close()


class CommandsCore:
    """``sandbox.commands``: run shell commands (``/bin/sh -c``) in the sandbox."""

    _flavour: Flavour
    _handle: type[CommandHandleCore]

    def __init__(self, sandbox: SandboxRef) -> None:
        self._sandbox = sandbox

    @operation
    def run(self, cmd: str, background: bool | None = None, envs: dict[str, str] | None = None,
            user: str | None = None, cwd: str | None = None, on_stdout: Callable[[str], Any] | None = None,
            on_stderr: Callable[[str], Any] | None = None, stdin: bool | str | None = None,
            timeout: float | None = 60, request_timeout: float | None = None,
            warm: bool = False) -> Steps[Any]:
        """Run ``cmd``; wait and return a ``CommandResult``, or with ``background=True`` a command handle.

        ``stdin=True`` keeps stdin open for ``send_stdin``; a string is written to stdin, which is then
        closed; by default stdin is empty. ``timeout`` (seconds, 0 = none) kills the command's process group.
        ``warm=True`` (forkd): ``cmd`` is a ``python3 ...`` command line, run as a fork of the snapshot's
        warm interpreter so its imports are already done (see docs/guest-protocol.md for the differences).
        """
        del request_timeout  # requests are bounded by the command's own timeout
        events = yield self._sandbox.api.start_exec(self._sandbox.sandbox_id,
                                                    **_exec_options(cmd, envs, user, cwd, stdin, timeout, warm))
        handle = yield from self._handle.start(self._sandbox, events)
        if background:
            return handle
        return (yield from CommandHandleCore.wait.steps(handle, on_stdout, on_stderr))

    @operation
    def kill(self, pid: int) -> Steps[bool]:
        """SIGKILL the command's process group; ``False`` if it had already ended."""
        return (yield from found(self._sandbox.api.signal_process, self._sandbox.sandbox_id, pid, 9))

    def send_stdin(self, pid: int, data: str) -> Any:
        """Write ``data`` to command ``pid``'s stdin (started with ``stdin=True``)."""
        return self._sandbox.api.send_stdin(self._sandbox.sandbox_id, pid, data)

    def close_stdin(self, pid: int) -> Any:
        """Close command ``pid``'s stdin: it reads end-of-file."""
        return self._sandbox.api.send_stdin(self._sandbox.sandbox_id, pid, "", eof=True)

    @operation
    def list(self) -> Steps[builtins.list[ProcessInfo]]:
        """Running commands and the last finished ones."""
        return [_process(p) for p in (yield self._sandbox.api.processes(self._sandbox.sandbox_id))]
