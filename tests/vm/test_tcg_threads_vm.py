"""Multi-vCPU guests boot clean under TCG: no kernel oops in their consoles, and on a QEMU whose
multi-threaded TCG races (before 8.1) their vCPUs share one host thread (``vmm/accel.accel_option``).

Booted through the QEMU backend itself (real QEMU, real kernel and agent), not a daemon: the console of
a parent that booted is not kept, and an oops in a task's context does not always stop the boot. The
race is rare (one CI boot; none in 20 looped boots here, bench/mttcg_boot.py), so the thread check is
what fails at once if the choice regresses; the console check catches the oops when it happens.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from conftest import run_bounded, short_tmp_dir

from forkd.config import paths_from_env
from forkd.runtime.agent_client import connect_when_answering
from forkd.runtime.snapshots import BASE_CMDLINE
from forkd.sdk.controller import Controller
from forkd.vmm.accel import MTTCG_FIXED_IN
from forkd.vmm.base import CONSOLE_LOG, BootSpec
from forkd.vmm.qemu import QemuVmm
from forkd.vmm.qemu_machine import QEMU_BINARY, monitor, qemu_version

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]
GUESTS, VCPUS = 3, 2
BOOT_BOUND_S = 400  # three 2-vCPU guests at once on a loaded 2-core host
#: What the guest kernel prints when it dies or is hurt (a stale int3 gave "Oops: int3").
KERNEL_TROUBLE = re.compile(r"Oops|BUG: |Kernel panic|general protection fault|invalid opcode|WARNING: CPU")


async def _boot_one(vmm: QemuVmm, image: Path, scratch: Path, index: int) -> tuple[set[int], str]:
    """Boot a guest to its agent's answer; its vCPU threads and its console."""
    manifest = json.loads((image / "manifest.json").read_text())
    spec = BootSpec(kernel=image / "vmlinuz", initrd=image / "initrd.img",
                    cmdline=f"{BASE_CMDLINE} forkd.hostname=mt{index}", memory_mib=512, vcpus=VCPUS,
                    kernel_sha256=manifest["kernel_sha256"], agent_version=manifest["agent_version"])
    run_dir = scratch / f"g{index}"
    run_dir.mkdir()
    vm = await vmm.boot(f"mt{index}", spec, run_dir, image / "rootfs.ext4", run_dir / "memory")
    try:
        agent, _ = await connect_when_answering(vm, BOOT_BOUND_S - 30)
        await agent.close()
        async with monitor(vm) as qmp:
            cpus = await qmp.execute("query-cpus-fast")
        return {cpu["thread-id"] for cpu in cpus}, (run_dir / CONSOLE_LOG).read_text(errors="replace")
    finally:
        await vmm.kill(vm)


def test_multi_vcpu_guests_boot_without_an_oops(daemon: Controller, vm_env: dict[str, str]) -> None:
    daemon.build_image(name="default")  # cached: built once per machine
    image = paths_from_env(vm_env).images / "default"
    vmm = QemuVmm(jail=None)  # the jail is tested elsewhere (tests/vm/test_confinement.py)
    with short_tmp_dir("fk-mt-") as scratch:
        async def boot_all() -> list[tuple[set[int], str]]:
            return await asyncio.gather(*(_boot_one(vmm, image, scratch, i) for i in range(GUESTS)))

        booted = run_bounded(boot_all, BOOT_BOUND_S)
    release = tuple(int(part) for part in qemu_version(QEMU_BINARY).split(".")[:2])
    racy = vmm.accelerator == "tcg" and release < MTTCG_FIXED_IN
    for threads, console in booted:
        assert not [line for line in console.splitlines() if KERNEL_TROUBLE.search(line)], console[-3000:]
        assert len(threads) == (1 if racy else VCPUS), threads
