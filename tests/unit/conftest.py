"""Fixtures shared by unit tests that drive the real runtime services without a VM."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from forkd.config import Paths
from forkd.runtime.isolation import Isolation
from forkd.runtime.metrics import Metrics
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.sandboxes import SandboxService
from forkd.runtime.snapshots import SnapshotService
from forkd.store.files import DigestCache
from forkd.store.registry import Registry
from forkd.store.snapshots import SnapshotStore
from forkd.vmm.qemu import QemuVmm


@pytest.fixture
def qemu_sandbox_service() -> Callable[[Paths, Registry], SandboxService]:
    """A factory: the real SandboxService over ``paths`` and ``registry``, with the QEMU backend (never started)."""

    def make(paths: Paths, registry: Registry) -> SandboxService:
        vmm = QemuVmm()
        store = SnapshotStore(paths.snapshots, registry, DigestCache(), vmm.identity)
        return SandboxService(paths, registry, vmm, SnapshotService(paths, store, vmm), Metrics(),
                              Isolation.from_options(registry, RuntimeOptions()))

    return make
