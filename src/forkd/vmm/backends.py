"""The VMM backends a daemon can run, by the name its configuration gives (``vmm = "qemu"``).

The daemon's composition root picks its backend here and nowhere else; everything above ``vmm/``
sees only the :class:`forkd.vmm.base.Vmm` it was handed. A new backend (Firecracker) is one more
entry. ``fake`` runs no VM at all (real processes speaking the real guest protocol, RAM as files;
``vmm/fake.py``): a whole daemon on it serves clients, clusters and their tests on hosts without
QEMU or KVM, in milliseconds per fork. What runs "in" its sandboxes is an answering stub.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from forkd.vmm.base import Vmm
from forkd.vmm.fake import FakeVmm
from forkd.vmm.jail import Jail, JailSettings
from forkd.vmm.qemu import QemuVmm
from forkd.vmm.qemu_machine import TCG_TB_SIZE_MIB

DEFAULT_BACKEND = "qemu"


class UnknownBackend(ValueError):
    """No backend has that name; the message lists those that do."""


@dataclass(frozen=True)
class BackendOptions:
    """What the daemon's configuration hands a backend; a backend ignores what it has no use for."""

    accelerator: str = "auto"  # auto | kvm | tcg
    tcg_tb_size_mib: int = TCG_TB_SIZE_MIB  # translation cache of a VMM that translates guest code
    vmm_huge_pages: bool = False  # transparent huge pages for the VMM's own memory (2-4 MiB more per child)
    confinement: JailSettings = JailSettings()  # each VMM's uid, namespaces and rlimits (vmm/jail.py)


def _qemu(options: BackendOptions) -> Vmm:
    """QEMU with each VMM jailed; a host that cannot jail them is refused here, at daemon start."""
    jail = Jail(options.confinement) if options.confinement.enabled else None
    if jail is not None:
        jail.check()
    return QemuVmm(accelerator=options.accelerator, tb_size_mib=options.tcg_tb_size_mib, jail=jail,
                   huge_pages=options.vmm_huge_pages)


BACKENDS: dict[str, Callable[[BackendOptions], Vmm]] = {
    "qemu": _qemu,
    "fake": lambda options: FakeVmm(),
}


def check_backend(name: str) -> str:
    """``name`` if a backend has it, else :class:`UnknownBackend` naming the known ones."""
    if name not in BACKENDS:
        raise UnknownBackend(f"unknown VMM backend {name!r}; the known backends are {', '.join(sorted(BACKENDS))}")
    return name


def create_vmm(name: str = DEFAULT_BACKEND, options: BackendOptions = BackendOptions()) -> Vmm:
    """The backend called ``name``, set up with ``options``."""
    return BACKENDS[check_backend(name)](options)
