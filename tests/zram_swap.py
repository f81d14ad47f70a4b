"""A zram swap device made for one test module or bench run and removed after (forkd itself never
configures swap: that is the operator's, docs/operations.md).

A device of its own (``/sys/class/zram-control/hot_add``), not ``zram0``, which an operator may use.
Needs root and the zram driver; :func:`unavailable` says when the driver is missing, so a caller can
tell a host without zram (skip) from a failure to set it up (fail).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CONTROL = Path("/sys/class/zram-control")


def unavailable() -> str | None:
    """Why this host's kernel cannot give a zram swap (no driver: a reason to skip); None: it can, given
    root (a test asks for it with the ``root`` mark, which fails without it)."""
    if not CONTROL.is_dir():
        return "this host's kernel has no zram driver (no /sys/class/zram-control)"
    return None


def mm_stat(device: str) -> dict[str, int]:
    """The zram device's ``mm_stat``: bytes stored (orig), compressed (compr) and its memory (mem_used)."""
    fields = Path(f"/sys/block/{device}/mm_stat").read_text().split()
    return {"orig_data_size": int(fields[0]), "compr_data_size": int(fields[1]), "mem_used_total": int(fields[2])}


@contextlib.contextmanager
def zram_swap(size_bytes: int, algorithm: str = "lzo-rle") -> Iterator[str]:
    """A swap on a new zram device of ``size_bytes`` (uncompressed) while in the block; its name."""
    number = int((CONTROL / "hot_add").read_text())
    device = f"zram{number}"
    block = Path("/sys/block") / device
    try:
        with contextlib.suppress(OSError):  # a kernel without this algorithm keeps its default
            (block / "comp_algorithm").write_text(algorithm)
        (block / "disksize").write_text(str(size_bytes))
        subprocess.run(["mkswap", f"/dev/{device}"], check=True, capture_output=True, timeout=30)
        # a priority above any other swap: pages paged out go here, not to an operator's disk swap
        subprocess.run(["swapon", "-p", "32000", f"/dev/{device}"], check=True, capture_output=True, timeout=30)
        yield device
    finally:
        _remove(device, number)


def _remove(device: str, number: int) -> None:
    """Swap off, reset and remove the device, retried a while (udev may still hold a new device open to
    probe it); a device that stays is an error, never left behind in silence (the host would keep a swap)."""
    problems: list[str] = []
    for _ in range(50):
        if f"/dev/{device} " in Path("/proc/swaps").read_text():
            # swapoff reads every page back in: bounded by the device's size, seconds at most here
            done = subprocess.run(["swapoff", f"/dev/{device}"], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                problems.append(done.stderr.strip())
                time.sleep(0.2)
                continue
        try:
            (Path("/sys/block") / device / "reset").write_text("1")
            (CONTROL / "hot_remove").write_text(str(number))
            return
        except OSError as exc:
            problems.append(str(exc))
            time.sleep(0.2)
    raise RuntimeError(f"the test's zram swap /dev/{device} could not be removed ({problems[-1]}); remove it "
                       f"by hand: swapoff /dev/{device}; echo {number} > {CONTROL}/hot_remove")
