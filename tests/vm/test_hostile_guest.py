"""A guest that attacks the host through what it controls: its agent port, its files, the text it returns.

Every attack runs as a real process in a real guest; the daemon, MCP server and CLI are the real ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters

from forkd.mcp.server import file_contains
from forkd.sdk.async_controller import AsyncController
from forkd.sdk.controller import Controller, ForkdError
from forkd.vmm.base import CONSOLE_KEEP_BYTES, CONSOLE_LOG, VmHandle
from conftest import vmm_processes_under

pytestmark = pytest.mark.vm

# Finds the agent's open virtio-serial port, takes a copy of that fd (pidfd_getfd, as root in the
# guest) and writes a line nested far deeper than any parser survives. The leading newline ends
# whatever line the agent was in the middle of.
HOSTILE_WRITER = r"""
import ctypes, os
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        fds = [(int(pid), int(fd)) for fd in os.listdir(f"/proc/{pid}/fd")
               if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/vport")]
    except OSError:
        continue
    if fds:
        break
pid, fd = fds[0]
libc = ctypes.CDLL(None, use_errno=True)
port = libc.syscall(438, os.pidfd_open(pid), fd, 0)  # pidfd_getfd
assert port >= 0, ctypes.get_errno()
os.write(port, b"\n" + b"[" * 100000 + b"]" * 100000 + b"\n")
"""
BOUND_S = 60.0


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {BOUND_S} s"
        time.sleep(0.2)


def test_a_guest_writing_hostile_frames_is_killed_and_released(daemon: Controller, children: list[str],
                                                               forkd_home: Path) -> None:
    attacker, sibling = children[0], children[1]
    run_dir = forkd_home / "sandboxes" / attacker
    assert vmm_processes_under(run_dir)
    with pytest.raises(ForkdError) as failed:
        daemon.exec(attacker, ["python3", "-c", HOSTILE_WRITER], timeout_s=60)
    # The call is cut by its sandbox being killed for the violation: 409 sandbox_ended, naming the violation.
    assert failed.value.status in (409, 502) and "broke the agent protocol" in failed.value.message, \
        failed.value.message

    def ended() -> bool:
        info = daemon.sandbox(attacker)
        return info["status"] != "running"

    _until(ended, "the attacker was not killed")
    info = daemon.sandbox(attacker)
    assert (info["status"], info["exit_reason"]) == ("killed", "agent_protocol_violation")
    _until(lambda: not run_dir.exists() and not vmm_processes_under(run_dir), "the attacker was not released")
    assert attacker not in [s["id"] for s in daemon.sandboxes()]
    assert daemon.health()  # the daemon serves on
    assert daemon.eval(sibling, "6 * 7")["value"] == "42"


def test_a_huge_guest_file_cannot_grow_a_client(daemon: Controller, children: list[str],
                                                vm_env: dict[str, str]) -> None:
    """The agent refuses to read devices (a symlink to /dev/zero); a sparse 64 GiB file is the same
    threat through a regular file: as much data as the guest likes, at no cost to it."""
    sandbox = children[2]
    made = daemon.exec(sandbox, "truncate -s 64G /tmp/zero && echo done > /tmp/log", timeout_s=30)
    assert made["exit_code"] == 0, (made, made.get("stderr"))
    with pytest.raises(ForkdError, match="holds more than 1048576 bytes"):
        daemon.read_file(sandbox, "/tmp/zero", max_bytes=1 << 20)

    async def scan(path: str, marker: bytes) -> bool:  # as MCP's wait_for_text does, on the async client
        async with AsyncController(connection=daemon.connection) as client:
            return await file_contains(client, sandbox, path, marker, 8 << 20)

    assert anyio.run(scan, "/tmp/zero", b"never") is False
    assert anyio.run(scan, "/tmp/log", b"done") is True

    env = {"FORKD_URL": f"unix://{vm_env['FORKD_SOCKET']}"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]

    async def through_mcp() -> None:
        params = StdioServerParameters(command=sys.executable, args=["-m", "forkd.mcp"], env=env)
        async with Client(params, read_timeout_seconds=120) as client:
            read = await client.call_tool("read_file", {"sandbox_id": sandbox, "path": "/tmp/zero"})
            assert read.is_error and "1048576" in "".join(getattr(b, "text", "") for b in read.content)
            waited = await client.call_tool("wait_for_text", {"sandbox_id": sandbox, "path": "/tmp/zero",
                                                              "text": "never", "timeout_s": 1})
            assert not waited.is_error and waited.structured_content["found"] is False

    anyio.run(through_mcp)


def test_guest_text_is_shown_not_interpreted_by_the_cli(daemon: Controller, children: list[str],
                                                        vm_env: dict[str, str]) -> None:
    sandbox = children[2]
    made = daemon.exec(sandbox, "touch \"$(printf '/tmp/[bold]loud[reset]\\033[31mred')\"", timeout_s=120)
    assert made["exit_code"] == 0, (made, made.get("stderr"))
    assert any("loud" in entry["name"] for entry in daemon.list_files(sandbox, "/tmp"))
    listed = subprocess.run([sys.executable, "-m", "forkd", "files", "ls", sandbox, "/tmp"], env=vm_env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "[bold]loud[reset]" in listed.stdout and "\x1b" not in listed.stdout, listed.stdout
    missing = subprocess.run([sys.executable, "-m", "forkd", "cp", f"{sandbox}:/tmp/[red]gone[/red]\x1b[2J", "-"],
                             env=vm_env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert "[red]gone[/red]" in missing.stderr and "\x1b" not in missing.stderr, missing.stderr


def test_a_console_the_guest_floods_is_cut_while_qemu_writes_on(daemon: Controller, children: list[str],
                                                                 forkd_home: Path) -> None:
    """QEMU appends to the console (append=on), so a cut leaves a small file and QEMU's next line
    lands right after the kept end, not at its old offset. The daemon cuts at 16 MiB; here the cut
    is made at once, with a small bound, on the real VMM's file."""
    sandbox = children[0]
    run_dir = forkd_home / "sandboxes" / sandbox
    console = run_dir / CONSOLE_LOG
    flood = daemon.exec(sandbox, "head -c 200000 /dev/zero | tr '\\0' x > /dev/ttyS0", timeout_s=300)
    assert flood["exit_code"] == 0, flood
    _until(lambda: console.stat().st_size >= 200000, "the flood did not reach the console")
    vm = VmHandle(name=sandbox, run_dir=run_dir, process=None, agent_socket=run_dir / "agent.sock")  # type: ignore[arg-type]
    assert vm.bound_logs(100000)
    assert daemon.exec(sandbox, "echo after-the-cut > /dev/ttyS0", timeout_s=60)["exit_code"] == 0
    _until(lambda: b"after-the-cut" in console.read_bytes(), "QEMU's next write did not follow the kept end")
    assert console.stat().st_size < CONSOLE_KEEP_BYTES + 1000
    assert console.read_bytes().startswith(b"[forkd: the console passed 100000 bytes")
