"""What differs between the QEMU machine types forkd runs (q35, microvm); the rest is one command line.

q35 is QEMU's PCI Express machine with ACPI and firmware; QEMU versions its layout (``pc-q35-7.2``),
so saved device state is pinned to that name. microvm has no PCI, no firmware (the kernel is loaded
directly) and its virtio devices on virtio-mmio, described to the guest in its ACPI tables: a
device state ~10x smaller and ~2.4 MiB less VMM memory per child (docs/benchmarks.md). QEMU does not
version microvm, so forkd versions its layout here (``MICROVM_LAYOUT_VERSION``): saved device state
never loads into a changed layout.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import time
from dataclasses import dataclass

from forkd.vmm.base import MICROVM, Q35, machine_of

#: forkd's version of its microvm layout: bump it whenever the options, devices or kernel arguments
#: below change for microvm, so snapshots of the old layout are refused (and named) instead of loaded.
MICROVM_LAYOUT_VERSION = 1
TSC_WINDOW_S = 0.05


@dataclass(frozen=True)
class MachineLayout:
    """One machine type as forkd runs it.

    ``bus`` is the suffix of its virtio devices (``pci`` on q35's PCI Express root; ``device``:
    virtio-mmio). ``options`` follow the machine type on ``-machine``. ``tsc_rate`` says the guest
    must be told the host's TSC rate on its kernel command line.
    """

    name: str
    bus: str
    options: tuple[str, ...] = ()
    tsc_rate: bool = False

    def virtio(self, device: str) -> str:
        """QEMU's name of the virtio ``device`` (``blk``, ``net``, ``serial``) on this machine's bus."""
        return f"virtio-{device}-{self.bus}"

    def kernel_args(self) -> list[str]:
        """What a parent's kernel is told on this machine beyond the snapshot's command line."""
        return [f"tsc_early_khz={host_tsc_khz()}"] if self.tsc_rate else []


Q35_LAYOUT = MachineLayout(Q35, "pci")
#: microvm without option ROMs, the legacy PIC and PIT (the guest has the IO-APIC and the TSC deadline
#: timer), with the ISA serial port (the console), and no command line of QEMU's own for virtio-mmio
#: devices (the guest finds them in the ACPI tables). Without a PIT or HPET the guest cannot calibrate
#: its TSC and hangs in boot: it is told the host's rate.
MICROVM_LAYOUT = MachineLayout(MICROVM, "device", ("x-option-roms=off", "pit=off", "pic=off", "isa-serial=on",
                                                   "auto-kernel-cmdline=off"), tsc_rate=True)
LAYOUTS = {layout.name: layout for layout in (Q35_LAYOUT, MICROVM_LAYOUT)}


def layout_of(machine: str) -> MachineLayout:
    """The layout of a machine name (``q35``, ``microvm``) or of a recorded identity (``microvm-forkd1``)."""
    return LAYOUTS[machine_of(machine)]


def microvm_identity() -> str:
    """What a microvm snapshot's identity records: forkd's version of the layout."""
    return f"{MICROVM}-forkd{MICROVM_LAYOUT_VERSION}"


@functools.cache
def host_tsc_khz(window_s: float = TSC_WINDOW_S) -> int:
    """The host's TSC rate in kHz, measured against the monotonic clock over ``window_s`` (once per daemon).

    Under TCG a guest reads the host's TSC (under KVM, with ``-cpu host``, it runs at the host's rate),
    so the host's rate is the guest's; a wrong one makes guest time run fast or slow.
    """
    code = bytes.fromhex("0f3148c1e2204809d0c3")  # rdtsc; shl rdx, 32; or rax, rdx; ret
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    rdtsc = ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(ctypes.c_char.from_buffer(page)))

    def reading() -> tuple[int, int]:
        """(monotonic ns, TSC) read together: of a few tries, the one least spread (not preempted)."""
        tries = []
        for _ in range(5):
            before, ticks, after = time.monotonic_ns(), rdtsc(), time.monotonic_ns()
            tries.append((after - before, (before + after) // 2, ticks))
        _, at, ticks = min(tries)
        return at, ticks

    started_ns, started = reading()
    time.sleep(window_s)
    ended_ns, ended = reading()
    return round((ended - started) * 1_000_000 / (ended_ns - started_ns))
