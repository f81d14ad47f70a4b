"""A QEMU VM that ends before its agent answers explains itself: who stopped QEMU (a signal and its
sender, a traced shutdown request, or a guest reset) and the guest console's last lines, bounded.

The VMM stand-ins are real processes that already ended; the logs are what QEMU 7.2 and a Debian
guest kernel write.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from forkd.runtime.agent_client import AgentUnavailable, connect_when_answering
from forkd.vmm.base import CONSOLE_LOG
from forkd.vmm.qemu_exit import (
    REPORT_LINE_CHARS,
    REPORT_LINES,
    VMM_LOG,
    QemuVm,
)

pytestmark = pytest.mark.timeout(60)

PANIC = [
    "[    9.412345] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100",
    "[    9.413000] CPU: 1 PID: 1 Comm: python3 Not tainted 6.12.12+bpo-cloud-amd64 #1",
    "[    9.420000] ---[ end Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100 ]---",
]


async def _ended_vm(run_dir: Path, how: str, vmm_log: str = "", console: str | bytes = "") -> QemuVm:
    """A VM whose process has already ended: ``exit0`` or ``sigkill``."""
    (run_dir / VMM_LOG).write_text(vmm_log)
    (run_dir / CONSOLE_LOG).write_bytes(console if isinstance(console, bytes) else console.encode())
    process = await asyncio.create_subprocess_exec("sleep", "300" if how == "sigkill" else "0")
    if how == "sigkill":
        process.kill()
    await process.wait()
    return QemuVm(name="parent-t", run_dir=run_dir, process=process, agent_socket=run_dir / "agent.sock")


def _failure(vm: QemuVm) -> str:
    async def attempt() -> str:
        with pytest.raises(AgentUnavailable) as failed:
            await connect_when_answering(vm, timeout=10)
        return failed.value.message

    return asyncio.run(attempt())


def test_a_guest_that_reset_itself_is_reported_with_its_last_console_lines(tmp_path: Path) -> None:
    early = [f"[    0.{i:06d}] early boot line {i}" for i in range(40)]
    vm = asyncio.run(_ended_vm(tmp_path, "exit0", console="\n".join([*early, *PANIC]) + "\n"))
    message = _failure(vm)
    assert message.startswith("the VM exited with status 0 before its agent answered: the guest reset itself")
    assert all(line in message for line in PANIC)
    assert "early boot line 0 " not in message and f"early boot line {40 - REPORT_LINES + len(PANIC)}" in message


def test_a_panic_headline_is_quoted_above_its_call_trace(tmp_path: Path) -> None:
    trace = [f"[    9.5{i:05d}]  frame_{i}+0x1a/0x30" for i in range(30)]
    log = "qemu-system-x86_64: warning: hub 0 is not connected to host network\n"
    vm = asyncio.run(_ended_vm(tmp_path, "exit0", vmm_log=log, console="\n".join([PANIC[0], *trace]) + "\n"))
    message = _failure(vm)
    assert f"{PANIC[0]} | ... | {trace[-REPORT_LINES]}" in message and trace[-REPORT_LINES - 1] not in message
    assert "hub 0" not in message  # the inert NIC's warning is not news


def test_a_signalled_qemu_names_the_signal_and_its_sender(tmp_path: Path) -> None:
    log = "qemu-system-x86_64: terminating on signal 15 from pid 4242 (pkill)\n"
    vm = asyncio.run(_ended_vm(tmp_path, "exit0", vmm_log=log, console="forkd-init: started agent, pid 90\n"))
    message = _failure(vm)
    assert "QEMU was sent SIGTERM from pid 4242 (pkill) and shut down" in message
    assert "reset itself" not in message and "forkd-init: started agent, pid 90" in message


def test_a_traced_shutdown_request_says_the_guest_powered_off(tmp_path: Path) -> None:
    console = "forkd-initramfs: no disk /dev/vda after 10 s\nforkd-initramfs: powering off\n"
    vm = asyncio.run(_ended_vm(tmp_path, "exit0", vmm_log="qemu_system_shutdown_request reason=6\n", console=console))
    message = _failure(vm)
    assert "the guest powered itself off" in message and "no disk /dev/vda after 10 s" in message


def test_a_killed_qemu_without_logs_says_so(tmp_path: Path) -> None:
    vm = asyncio.run(_ended_vm(tmp_path, "sigkill"))
    message = _failure(vm)
    assert f"status {-signal.SIGKILL}" in message
    assert "QEMU was killed by SIGKILL" in message and "the guest console is empty" in message


def test_a_hostile_console_is_quoted_bounded_and_inert(tmp_path: Path) -> None:
    flood = (b"x" * 10_000 + b"\r\n") * 500 + (b"\x1b[2J\x1b]0;owned\x07" * 2_000 + b"\n") * 50
    vm = asyncio.run(_ended_vm(tmp_path, "exit0", console=flood))
    message = _failure(vm)
    assert len(message) < 400 + REPORT_LINES * (REPORT_LINE_CHARS + 3)
    assert "\x1b" not in message and "\r" not in message and "\n" not in message
    assert "\\x1b[2J" in message  # shown, as an escape
