"""``forkd exec`` against a real guest, as ``docker exec`` behaves: ``-i`` passes stdin, ``-w`` and ``-e`` set
the directory and environment, and the status is the command's own, 127 for a program that is not there,
126 for one that cannot be executed (the fake backend's guest only answers stubs: tests/unit/test_cli_scripting.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from forkd.sdk.controller import Controller


@pytest.fixture
def sandbox(daemon: Controller, snapshot_tag: str) -> Iterator[str]:
    sandbox_id = daemon.fork(snapshot_tag, 1)["sandboxes"][0]["id"]
    yield sandbox_id
    daemon.kill(sandbox_id)


def test_cli_exec_passes_stdin_and_reports_why_a_command_never_ran(daemon: Controller, sandbox: str,
                                                                   vm_env: dict[str, str]) -> None:
    def forkd(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "forkd", "exec", *args], env=vm_env, input=stdin,
                              capture_output=True, text=True, timeout=300)

    doubled = forkd("-i", sandbox, "--", "python3", "-c", "print(int(input())*21)", stdin="2\n")
    assert (doubled.returncode, doubled.stdout) == (0, "42\n"), doubled.stderr
    copied = forkd("-i", sandbox, "--", "wc", "-c", stdin="é" * 100_000)  # many chunks, one multi-byte char split
    assert copied.stdout.strip() == "200000", copied.stderr
    assert forkd(sandbox, "--", "cat", stdin="not passed without -i").stdout == ""  # and cat ends: stdin is closed
    where = forkd("-w", "/tmp", "-e", "GREETING=hi", sandbox, "--", "sh", "-c", 'echo "$GREETING $PWD"')
    assert where.stdout == "hi /tmp\n", where.stderr
    assert forkd(sandbox, "--", "sh", "-c", "exit 3").returncode == 3

    missing = forkd(sandbox, "--", "no-such-program")
    assert missing.returncode == 127 and "no-such-program" in missing.stderr, missing.stderr
    daemon.write_file(sandbox, "/tmp/data.txt", b"not a program\n", mode=0o644)
    assert forkd(sandbox, "--", "/tmp/data.txt").returncode == 126
    assert forkd(sandbox, "--", "/tmp").returncode == 126  # a directory
    assert forkd("-w", "/no/such/dir", sandbox, "--", "true").returncode == 126  # the program exists; the dir not
    assert forkd("--shell", sandbox, "--", "no-such-program").returncode == 127  # the shell's own 127
    assert forkd("sb-000000000000", "--", "true").returncode == 125


def test_cli_exec_t_and_shell_run_on_a_terminal(daemon: Controller, sandbox: str, vm_env: dict[str, str]) -> None:
    """The guest's PTY through REST (exec with pty, /stdin with pty): not a terminal here, so piped input is
    typed in and ends with ^D, and the size is the default 24x80."""
    def forkd(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "forkd", *args], env=vm_env, input=stdin,
                              capture_output=True, text=True, timeout=300)

    on_tty = forkd("exec", "-t", sandbox, "--", "sh", "-c", "tty; stty size; echo $TERM; exit 5")
    assert on_tty.returncode == 5, on_tty.stderr
    assert "/dev/pts/" in on_tty.stdout and "24 80" in on_tty.stdout and "xterm" in on_tty.stdout
    typed = forkd("exec", "-t", sandbox, "--", "sh", "-c", "read line; echo got:$line", stdin="hello\n")
    assert "got:hello" in typed.stdout and typed.returncode == 0, typed.stderr
    shell = forkd("shell", sandbox, stdin="echo in-shell:$((6*7))\nexit 4\n")
    assert "in-shell:42" in shell.stdout and shell.returncode == 4, shell.stderr
    assert forkd("shell", "sb-000000000000").returncode == 125
    assert forkd("exec", "-t", "--json", sandbox, "--", "true").returncode == 2
