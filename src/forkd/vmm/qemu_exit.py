"""Why a QEMU VM ended, told from its own log, its exit status and the guest's serial console.

Read only from the ends of the files (a guest can make its console log huge), every line clipped and
its control characters made visible: the report goes into error messages a client reads.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from forkd.safetext import visible
from forkd.vmm.base import CONSOLE_LOG, VmHandle

#: In a VM's run directory: QEMU's own stdout and stderr (the guest's console is base.CONSOLE_LOG).
VMM_LOG = "qemu.log"
#: Traced into the VMM log, so an exit says who asked for it: a guest poweroff or a monitor ``quit``
#: (both exit 0, as a guest reset does under -no-reboot, which this trace does not see).
SHUTDOWN_TRACE = "qemu_system_shutdown_request"
#: QEMU's ShutdownCause numbers (qapi/run-state.json) that reach that trace.
_SHUTDOWN_CAUSES = {
    1: "QEMU stopped on an error of its own",
    2: "QEMU was told to quit over its monitor",
    5: "QEMU's user interface was closed",
    6: "the guest powered itself off (an initramfs failure powers off; see the console)",
    8: "the guest reported a panic",
}
_SHUTDOWN_REQUESTED = re.compile(rf"{SHUTDOWN_TRACE} reason=(\d+)")
_SIGNALLED = re.compile(r"terminating on signal (\d+)(?: from pid (\d+)(?: \(([^)]*)\))?)?")
#: How much of a log an exit report quotes: the last lines, each clipped, of the file's last bytes.
REPORT_LINES, REPORT_LINE_CHARS, REPORT_READ_BYTES = 12, 240, 16 * 1024
#: Guest kernel lines that say why it died, quoted even when a call trace pushed them up.
_KERNEL_HEADLINE = re.compile(r"Kernel panic - not syncing|BUG: |Oops|general protection fault|double fault|"
                              r"soft lockup|self-detected stall|Attempted to kill init|Out of memory")
#: What QEMU always says about the inert NIC a parent is booted with (``_INERT_NETDEV``): not news.
_INERT_HUB_WARNING = "is not connected to host network"


def _read_end(path: Path, nbytes: int) -> str | None:
    """The last ``nbytes`` of a file, decoded; None if it cannot be read. Never the whole file: a
    guest can make its console log huge."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return None


def tail(path: Path, limit: int = 800) -> str:
    """The end of a log, for an error message."""
    text = _read_end(path, limit * 4)  # enough bytes for ``limit`` characters of any UTF-8
    if text is None:
        return "(no log)"
    return text.strip()[-limit:] or "(empty log)"


def log_lines(path: Path) -> list[str]:
    """The non-blank lines at the end of a log, control characters made visible, each clipped."""
    lines = [line.strip() for line in (_read_end(path, REPORT_READ_BYTES) or "").splitlines()]
    return [visible(line)[:REPORT_LINE_CHARS] for line in lines if line]


def console_excerpt(lines: list[str]) -> list[str]:
    """The console's last lines, after the kernel's last headlines (a panic's reason, an oops) above them."""
    last = lines[-REPORT_LINES:]
    headlines = [line for line in lines[:-REPORT_LINES] if _KERNEL_HEADLINE.search(line)][-3:]
    return [*headlines, "...", *last] if headlines else last


def shutdown_cause(vmm_log: list[str]) -> str | None:
    """Who asked QEMU to stop, if its log says: a signal (QEMU names the sender) or a traced request."""
    for line in reversed(vmm_log):
        if match := _SIGNALLED.search(line):
            sender = f" from pid {match[2]}" + (f" ({match[3]})" if match[3] else "") if match[2] else ""
            return f"QEMU was sent {_signal_name(int(match[1]))}{sender} and shut down"
        if match := _SHUTDOWN_REQUESTED.search(line):
            return _SHUTDOWN_CAUSES.get(int(match[1]), f"QEMU shut down (cause {match[1]})")
    return None


def status_cause(status: int | None) -> str | None:
    """What an exit status alone says about a QEMU that ended without logging why."""
    if status is not None and status < 0:
        return f"QEMU was killed by {_signal_name(-status)}"
    if status == 0:
        return ("the guest reset itself: a kernel panic (panic=-1 reboots at once), a triple fault or a "
                "reboot, which -no-reboot turns into an exit")
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class QemuVm(VmHandle):
    """A QEMU VM, which reports its own end from QEMU's log and the guest's serial console."""

    def exit_report(self) -> str:
        vmm_log = [line for line in log_lines(self.run_dir / VMM_LOG) if _INERT_HUB_WARNING not in line]
        parts = []
        if (cause := shutdown_cause(vmm_log)) is not None:
            parts.append(cause)
        else:
            parts.append(status_cause(self.process.returncode) or "")
            parts.append("QEMU's log ends: " + " | ".join(vmm_log[-3:]) if vmm_log else "")
        console = console_excerpt(log_lines(self.run_dir / CONSOLE_LOG))
        parts.append("the guest console ends: " + " | ".join(console) if console else "the guest console is empty")
        return "; ".join(part for part in parts if part)
