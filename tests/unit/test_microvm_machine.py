"""The machine type of a snapshot (q35 or microvm): the request and its refusal, the meta and identity
it records, the QEMU command line of each, and the host TSC rate microvm guests are told."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import short_tmp_dir
from forkd.daemon.config import load_config
from forkd.daemon.schemas import SnapshotCreate
from forkd.packs.format import PackError, PackSnapshot, check_meta
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.snapshots import SnapshotRequest
from forkd.store.errors import SnapshotError
from forkd.store.snapshots import boot_spec
from forkd.vmm import qemu_machine
from forkd.vmm.base import BootSpec, MachineIdentity, SnapshotMismatch, machine_of
from forkd.vmm.fake import FakeVmm
from forkd.vmm.jail import Jail
from forkd.vmm.qemu import QemuVmm
from forkd.vmm.qemu_layout import MICROVM_LAYOUT, Q35_LAYOUT, host_tsc_khz, layout_of
from test_runtime_fake_vmm import _image, _runtime, run


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_tmp_dir("fkm-") as directory:
        yield directory


def _spec(tmp_path: Path, machine: str) -> BootSpec:
    return BootSpec(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd.img", cmdline="console=ttyS0",
                    memory_mib=256, vcpus=1, kernel_sha256="0" * 64, agent_version="0", machine=machine)


def _argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, machine: str, share: bool) -> list[str]:
    monkeypatch.setattr(qemu_machine, "machine_type", lambda _binary: "pc-q35-7.2")
    return qemu_machine.QemuMachine("qemu-system-x86_64", "tcg", "qemu64").argv(
        _spec(tmp_path, machine), tmp_path, tmp_path / "disk.qcow2", tmp_path / "ram", share=share)


def _after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_a_microvm_has_its_devices_on_virtio_mmio_and_is_told_the_tsc_rate(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    argv = _argv(tmp_path, monkeypatch, "microvm", share=True)
    assert _after(argv, "-machine") == ["microvm,memory-backend=ram,x-option-roms=off,pit=off,pic=off,isa-serial=on,"
                                        "auto-kernel-cmdline=off"]
    devices = " ".join(_after(argv, "-device"))
    assert "virtio-blk-device,drive=root" in devices and "virtio-net-device,netdev=net0" in devices
    assert "virtio-serial-device" in devices and "vmgenid" in devices and "-pci" not in devices
    assert _after(argv, "-append") == [f"console=ttyS0 tsc_early_khz={host_tsc_khz()}"]
    child = _argv(tmp_path, monkeypatch, "microvm", share=False)  # a child's kernel is in the RAM it maps
    assert "-append" not in child and _after(child, "-machine") == _after(argv, "-machine")


def test_a_q35_command_line_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = _argv(tmp_path, monkeypatch, "q35", share=True)
    assert _after(argv, "-machine") == ["pc-q35-7.2,memory-backend=ram"]
    assert _after(argv, "-append") == ["console=ttyS0"]
    assert "virtio-blk-pci,drive=root,id=rootdisk" in _after(argv, "-device")


def test_identities_pin_q35_by_qemu_and_microvm_by_forkds_layout_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qemu_machine, "machine_type", lambda _binary: "pc-q35-7.2")
    machine = qemu_machine.QemuMachine("qemu-system-x86_64", "tcg", "qemu64")
    assert machine.identity_of("q35") == "pc-q35-7.2"
    assert machine.identity_of("microvm") == "microvm-forkd1"
    assert machine_of("microvm-forkd1") == "microvm" and machine_of("pc-q35-7.2") == "q35"
    assert layout_of("microvm-forkd1") is MICROVM_LAYOUT and layout_of("pc-q35-7.2") is Q35_LAYOUT


def test_a_qemu_without_microvm_offers_only_q35(tmp_path: Path) -> None:
    binary = tmp_path / "qemu-without-microvm"
    binary.write_text("#!/bin/sh\ncat <<'END'\nSupported machines are:\nq35  Standard PC (alias of pc-q35-7.2)\n"
                      "pc-q35-7.2  Standard PC (Q35 + ICH9, 2009)\nEND\n")
    binary.chmod(0o755)
    assert qemu_machine.QemuMachine(str(binary), "tcg", "qemu64").machines() == ("q35",)
    binary.write_text(binary.read_text().replace("END\n", "microvm  microvm (i386)\nEND\n"))
    qemu_machine.has_machine.cache_clear()
    assert qemu_machine.QemuMachine(str(binary), "tcg", "qemu64").machines() == ("q35", "microvm")


def test_capabilities_does_the_backends_one_time_work_so_the_first_command_line_does_none(tmp_path: Path) -> None:
    """The runtime calls capabilities off the event loop at start; the first microvm command line, built on
    the loop, must then neither measure the TSC (~50 ms) nor run QEMU, and the first start must not check
    the jail nor scan /proc for its uids."""
    binary = tmp_path / "qemu"
    binary.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'QEMU emulator version 7.2.22'; exit 0; }\n"
                      "cat <<'END'\nq35  Standard PC (alias of pc-q35-7.2)\nmicrovm  microvm (i386)\nEND\n")
    binary.chmod(0o755)
    cached = (qemu_machine.qemu_version, qemu_machine.machine_type, qemu_machine.has_machine, host_tsc_khz)
    for function in cached:
        function.cache_clear()
    jail, scans = Jail(), []
    jail._find_problems = list  # type: ignore[method-assign]  # a host that can confine (no namespaces made here)
    jail.uids._claims_path = None
    jail.uids._scan = lambda ids: scans.append(ids) or []  # type: ignore[assignment]
    vmm = QemuVmm(str(binary), accelerator="tcg", jail=jail)
    assert vmm.capabilities().machines == ("q35", "microvm")
    assert scans and jail._problems == [] and host_tsc_khz.cache_info().currsize == 1
    done = [function.cache_info().misses for function in cached]
    argv = vmm.machine.argv(_spec(tmp_path, "microvm"), tmp_path, tmp_path / "disk.qcow2", tmp_path / "ram", share=True)
    assert f"tsc_early_khz={host_tsc_khz()}" in _after(argv, "-append")[0]
    vmm.machine.argv(_spec(tmp_path, "q35"), tmp_path, tmp_path / "disk.qcow2", tmp_path / "ram", share=True)
    assert [function.cache_info().misses for function in cached] == done
    jail.uids.release(jail.uids.allocate())
    assert len(scans) == 1
    for function in cached:  # the next test measures this host's own QEMU and TSC
        function.cache_clear()


def test_the_host_tsc_rate_is_the_kernels_calibration() -> None:
    """A wrong rate makes a microvm guest's clock run fast or slow; the host kernel's own figure is in cpuinfo."""
    mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith("cpu MHz")]
    assert mhz and abs(host_tsc_khz() / 1000 - mhz[0]) / mhz[0] < 0.05, (host_tsc_khz(), mhz)


def test_a_microvm_snapshot_records_its_machine_and_restores_on_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm(), tag=None)
        try:
            record = await runtime.snapshots.create(SnapshotRequest(tag="mvm", memory_mib=1, warm_modules=(),
                                                                    machine="microvm"),
                                                    _image(tmp_path), lambda _line: None)
            assert record.meta["boot"]["machine"] == "microvm"
            assert record.meta["identity"]["machine"] == "microvm-fake1"
            _, _, spec = runtime.store.open("mvm")
            assert spec.machine == "microvm"
            [outcome] = await runtime.spawner.fork("mvm", 1)
            assert outcome.error is None
            q35 = await runtime.snapshots.create(SnapshotRequest(tag="q35", memory_mib=1, warm_modules=()),
                                                 _image(tmp_path), lambda _line: None)
            assert q35.meta["boot"]["machine"] == "q35" and q35.meta["identity"]["machine"] == "fake-1"
        finally:
            await runtime.stop()
    run(scenario)


def test_the_configured_default_machine_applies_to_a_request_naming_none(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm(), tag=None, options=RuntimeOptions(default_machine="microvm"))
        try:
            assert runtime.snapshots.resolve(SnapshotRequest(tag="x")).machine == "microvm"
            assert runtime.snapshots.resolve(SnapshotRequest(tag="x", machine="q35")).machine == "q35"
        finally:
            await runtime.stop()
    run(scenario)
    assert load_config(None, env={}).runtime_options.default_machine == "q35"
    config = tmp_path / "forkd.toml"
    config.write_text('vmm_machine = "microvm"\n')
    assert load_config(config, env={}).runtime_options.default_machine == "microvm"
    config.write_text('vmm_machine = "pc"\n')
    with pytest.raises(ValueError, match="vmm_machine"):
        load_config(config, env={})


def test_a_backend_without_microvm_refuses_at_create_before_booting(tmp_path: Path) -> None:
    async def scenario() -> None:
        vmm = FakeVmm(machines=("q35",))
        runtime = await _runtime(tmp_path, vmm, tag=None)
        try:
            with pytest.raises(SnapshotError, match="cannot run machine type 'microvm'.*--machine q35"):
                await runtime.snapshots.create(SnapshotRequest(tag="mvm", machine="microvm"), _image(tmp_path),
                                               lambda _line: None)
            assert vmm.requests == [] and runtime.store.held_for("mvm") is None  # nothing booted, tag free
            assert runtime.registry.get_snapshot("mvm") is None
        finally:
            await runtime.stop()
    run(scenario)


def test_the_rest_request_takes_only_known_machines() -> None:
    assert SnapshotCreate(tag="t").machine is None
    assert SnapshotCreate(tag="t", machine="microvm").machine == "microvm"
    with pytest.raises(ValueError, match="machine"):
        SnapshotCreate(tag="t", machine="pc-i440fx")


def test_old_snapshots_without_a_recorded_machine_restore_as_q35(tmp_path: Path) -> None:
    meta = {"boot": {"cmdline": "", "memory_mib": 1, "vcpus": 1, "kernel_sha256": "0", "agent_version": "1"}}
    assert boot_spec(tmp_path, meta).machine == "q35"


def test_a_changed_microvm_layout_is_refused_naming_it(tmp_path: Path) -> None:
    """A snapshot of layout 1 must not load into layout 2: the store names the difference."""
    async def scenario() -> None:
        runtime = await _runtime(tmp_path, FakeVmm(), tag=None)
        try:
            await runtime.snapshots.create(SnapshotRequest(tag="mvm", memory_mib=1, warm_modules=(), machine="microvm"),
                                           _image(tmp_path), lambda _line: None)
            host = runtime.store.host_identity
            runtime.store.host_identity = lambda spec: MachineIdentity(**{
                **host(spec).__dict__, "machine": host(spec).machine.replace("fake1", "fake2")})
            with pytest.raises(SnapshotMismatch, match="machine: saved 'microvm-fake1', now 'microvm-fake2'"):
                runtime.store.open("mvm")
        finally:
            await runtime.stop()
    run(scenario)


def test_a_pack_whose_boot_machine_contradicts_its_identity_is_refused(tmp_path: Path) -> None:
    identity = FakeVmm().identity(_spec(tmp_path, "q35"))
    meta = {"identity": identity.__dict__, "sha256": {}, "boot": {"memory_mib": 256, "vcpus": 1, "machine": "microvm"}}
    entry = PackSnapshot.model_construct(tag="t", files=[])
    with pytest.raises(PackError, match="boots machine 'microvm' but records 'fake-1'"):
        check_meta(entry, json.dumps(meta).encode(), identity)
