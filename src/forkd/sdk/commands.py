"""``sandbox.commands``: shell commands in a sandbox, in the foreground or the background (E2B's shape)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from forkd.sdk.controller import EventStream
from forkd.sdk.errors import ForkdError, NotFoundException, TimeoutException
from forkd.sdk.models import CommandExitException, CommandResult, ProcessInfo
from forkd.sdk.ref import SandboxRef


class CommandHandle:
    """A command started in the background: its ``pid``, ``wait()``, ``kill()``, ``send_stdin()``."""

    def __init__(self, sandbox: SandboxRef, events: EventStream) -> None:
        self._sandbox = sandbox
        self._events = events
        self._iterator = iter(events)
        first = next(self._iterator, None)
        if first is None or first.get("event") != "started":
            events.close()
            raise ForkdError(500, "no_start", f"the command did not report a start: {first or events.result}")
        self.pid: int = first["pid"]
        self._stdout: list[str] = []
        self._stderr: list[str] = []

    def __iter__(self) -> Iterator[tuple[str | None, str | None, None]]:
        """``(stdout, stderr, pty)`` pieces as they arrive, one set, as E2B's handle yields them."""
        for event in self._iterator:
            name, data = event.get("event"), event.get("data", "")
            if name == "stdout":
                self._stdout.append(data)
                yield data, None, None
            elif name == "stderr":
                self._stderr.append(data)
                yield None, data, None

    def wait(self, on_stdout: Callable[[str], Any] | None = None,
             on_stderr: Callable[[str], Any] | None = None) -> CommandResult:
        """Block until the command ends; raises ``CommandExitException`` if it exits non-zero."""
        for stdout, stderr, _ in self:
            if stdout is not None and on_stdout is not None:
                on_stdout(stdout)
            if stderr is not None and on_stderr is not None:
                on_stderr(stderr)
        outcome = self._events.result or {}
        if outcome.get("timed_out"):
            raise TimeoutException(504, "timeout", f"command {self.pid} ran past its timeout and was killed")
        result = CommandResult(stdout="".join(self._stdout), stderr="".join(self._stderr),
                               exit_code=outcome.get("exit_code", -1), error=_signal_error(outcome),
                               truncated=bool(outcome.get("truncated")))
        if result.exit_code != 0:
            raise CommandExitException(result)
        return result

    def kill(self) -> bool:
        """SIGKILL the command's process group; ``False`` if it had already ended."""
        return self._sandbox.commands.kill(self.pid)

    def send_stdin(self, data: str) -> None:
        self._sandbox.commands.send_stdin(self.pid, data)

    def disconnect(self) -> None:
        """Stop reading its output; the command keeps running (kill it with ``commands.kill(pid)``)."""
        self._events.close()


def _signal_error(outcome: dict[str, Any]) -> str | None:
    return f"killed by signal {outcome['signal']}" if outcome.get("signal") else None


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
            self._sandbox.sandbox_id, cmd, env=envs, cwd=cwd, user=user, timeout_s=timeout or None,
            stdin=None if stdin is True else (stdin or ""), warm=warm))
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
        return [ProcessInfo(pid=p["pid"], cmd=p.get("shell") or " ".join(p.get("argv", [])),
                            args=list(p.get("argv", [])), running=p["running"], exit_code=p["exit_code"],
                            started_at=p.get("started_at"))
                for p in self._sandbox.api.processes(self._sandbox.sandbox_id)]
