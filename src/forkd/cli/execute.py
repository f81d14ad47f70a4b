"""``forkd exec``: a command in a sandbox run as ``docker exec`` runs one.

Its output streams, its exit status is forkd's; ``-i`` passes this process's stdin through while it
runs. When the command never ran, the status says why, as Docker's does, so an eval harness can tell a
broken sandbox from a failing test: 125 forkd failed (daemon unreachable, unknown sandbox, refused
request), 126 the program could not be executed, 127 it was not found.
"""

from __future__ import annotations

import codecs
import sys
import threading
from typing import Any

import click

from forkd.cli.common import daemon, err_console, fail, json_option, key_values, print_json
from forkd.cli.terminal import SHELL, run_on_terminal
from forkd.sdk.controller import Controller, ForkdError

EXIT_FORKD_FAILED = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
STDIN_CHUNK_BYTES = 64 << 10
#: The guest's errno (the agent sends it when spawning fails) for a program there but not runnable.
NOT_EXECUTABLE_ERRNOS = frozenset({"EACCES", "ENOEXEC", "EISDIR", "ENOTDIR", "EPERM", "ELOOP"})


def status_for(exc: ForkdError, workdir: str | None) -> int:
    """126/127 when the guest could not start the program (it reports the errno), 125 for anything else."""
    errno = exc.details.get("errno")
    if errno == "ENOENT" and not (workdir and repr(workdir) in exc.message):  # a missing workdir is no program
        return EXIT_NOT_FOUND
    if errno in NOT_EXECUTABLE_ERRNOS or errno == "ENOENT":
        return EXIT_NOT_EXECUTABLE
    return EXIT_FORKD_FAILED


def _pump_stdin(controller: Controller, sandbox_id: str, pid: int) -> None:
    """Copy our stdin to the command's as it arrives, then close it; stops quietly once the command has ended."""
    source = click.get_binary_stream("stdin")
    read = getattr(source, "read1", source.read)  # read1: what is there now, so an interactive line goes at once
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # the API carries text
    try:
        while chunk := read(STDIN_CHUNK_BYTES):
            if text := decoder.decode(chunk):
                controller.send_stdin(sandbox_id, pid, text)
        controller.send_stdin(sandbox_id, pid, decoder.decode(b"", final=True), eof=True)
    except (ForkdError, OSError, ValueError):
        return  # the command ended (or stdin closed under us): its result says how


def _write(stream: Any, data: str) -> None:
    stream.write(data)
    stream.flush()


def _run(controller: Controller, sandbox_id: str, command: str | list[str], interactive: bool,
         **options: Any) -> dict[str, Any]:
    """Stream the command's output to ours (and our stdin to it with ``interactive``); its result."""
    events = controller.start_exec(sandbox_id, command, stdin=None if interactive else "", **options)
    for event in events:
        kind = event.get("event")
        if kind == "started" and interactive:
            threading.Thread(target=_pump_stdin, args=(controller, sandbox_id, event["pid"]), daemon=True).start()
        elif kind == "stdout":
            _write(sys.stdout, event["data"])
        elif kind == "stderr":
            _write(sys.stderr, event["data"])
    return events.result  # type: ignore[no-any-return]


@click.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("-i", "--interactive", is_flag=True, help="pass stdin to the command (otherwise it reads nothing)")
@click.option("-t", "--tty", is_flag=True, help="run it on a terminal (keys, colours, resizes pass through)")
@click.option("--shell", "-s", is_flag=True, help="run COMMAND as one /bin/sh -c string")
@click.option("--env", "-e", "envs", multiple=True, help="KEY=VALUE (repeatable)")
@click.option("-w", "--workdir", "--cwd", "workdir", help="directory to run COMMAND in")
@click.option("--timeout", default=60.0, show_default=True, help="seconds")
@click.option("--warm", is_flag=True, help="COMMAND is python3 ...: run it as a fork of the warm interpreter")
@json_option
def exec_command(sandbox_id: str, command: tuple[str, ...], interactive: bool, tty: bool, shell: bool,
                 envs: tuple[str, ...], workdir: str | None, timeout: float, warm: bool, as_json: bool) -> None:
    """Run a command in a sandbox, streaming its output; exits with the command's status.

    If it never ran: 125 forkd failed (daemon unreachable, no such sandbox), 126 not executable,
    127 not found. With --json, prints the result (exit_code, stdout, stderr) once it ended.
    """
    argv: str | list[str] = " ".join(command) if shell else list(command)
    if tty and (as_json or warm):
        raise click.UsageError("-t runs the command on a terminal: it takes neither --json nor --warm")
    options: dict[str, Any] = {"env": key_values(envs, "--env"), "cwd": workdir, "timeout_s": timeout}
    try:
        controller = daemon()
        if tty:  # a terminal has no deadline of its own (the API's PTY runs until its program ends)
            result = run_on_terminal(controller, sandbox_id, argv, env=options["env"], cwd=workdir)
        elif as_json:
            stdin = click.get_text_stream("stdin").read() if interactive else ""
            result = controller.exec(sandbox_id, argv, stdin=stdin, warm=warm, **options)
            print_json(result)
        else:
            result = _run(controller, sandbox_id, argv, interactive, warm=warm, **options)
    except ForkdError as exc:
        fail(exc, as_json, status_for(exc, workdir))
    if result.get("timed_out") and not as_json:
        err_console.print(f"[red]timed out after {timeout} s[/red]")
    code = result.get("exit_code")
    sys.exit(code if isinstance(code, int) else EXIT_FORKD_FAILED)


@click.command("shell")
@click.argument("sandbox_id")
@click.option("-w", "--workdir", help="directory to start in")
def shell_command(sandbox_id: str, workdir: str | None) -> None:
    """A login shell in a sandbox, on a terminal (bash where the image has it); exits with its status."""
    try:
        result = run_on_terminal(daemon(), sandbox_id, SHELL, cwd=workdir)
    except ForkdError as exc:
        fail(exc, False, EXIT_FORKD_FAILED)
    code = result.get("exit_code")
    sys.exit(code if isinstance(code, int) else EXIT_FORKD_FAILED)
