import os
from dataclasses import asdict
from pathlib import Path

import pytest

from forkd.store.files import DigestCache, sha256_file, write_json_atomic
from forkd.vmm.accel import probe_kvm
from forkd.vmm.base import MachineIdentity
from forkd.vmm.qemu_machine import cpu_model, machine_type

IDENTITY = MachineIdentity("qemu", "7.2.22", "q35", "tcg", "qemu64", 1024, 1, "k" * 64, "0.1.0")


def test_identity_differences_name_each_field() -> None:
    other = MachineIdentity(**{**asdict(IDENTITY), "vmm_version": "10.0.2", "memory_mib": 512})
    assert IDENTITY.differences(IDENTITY) == []
    assert IDENTITY.differences(other) == ["vmm_version: saved '7.2.22', now '10.0.2'",
                                           "memory_mib: saved 1024, now 512"]
    assert MachineIdentity.from_dict({**asdict(IDENTITY), "extra": 1}) == IDENTITY


def _fake_host(tmp_path: Path, flags: str, pvm: bool) -> dict:
    (tmp_path / "cpuinfo").write_text(f"processor : 0\nflags\t\t: fpu sse2 {flags}\n")
    (tmp_path / "modules").mkdir()
    if pvm:
        (tmp_path / "modules" / "kvm_pvm").mkdir()
    (tmp_path / "kvm").write_text("")
    return {"dev": tmp_path / "kvm", "cpuinfo": tmp_path / "cpuinfo", "modules": tmp_path / "modules"}


def test_pvm_kvm_is_not_usable(tmp_path: Path) -> None:
    probe = probe_kvm(**_fake_host(tmp_path, "", pvm=True))
    assert probe.present and probe.pvm and not probe.usable and "PVM" in probe.detail


def test_hardware_kvm_is_usable(tmp_path: Path) -> None:
    assert probe_kvm(**_fake_host(tmp_path, "vmx", pvm=False)).usable


def test_missing_kvm(tmp_path: Path) -> None:
    probe = probe_kvm(dev=tmp_path / "nope", cpuinfo=tmp_path / "nope", modules=tmp_path)
    assert not probe.present and not probe.usable


def test_digest_cache_rehashes_only_changed_files(tmp_path: Path) -> None:
    path = tmp_path / "layer"
    path.write_bytes(b"one")
    cache = DigestCache()
    first = cache.sha256(path)
    assert first == sha256_file(path)
    cache.remember(path, "trusted")
    assert cache.sha256(path) == "trusted"  # unchanged file: the remembered digest, no rehash
    path.write_bytes(b"two!")
    assert cache.sha256(path) == sha256_file(path) != first


def test_digest_cache_keeps_a_digest_across_chmod_and_link_but_not_across_a_write(tmp_path: Path) -> None:
    path = tmp_path / "kernel"
    path.write_bytes(b"kernel")
    cache = DigestCache()
    cache.remember(path, "trusted")  # stands for a digest computed while writing: not read again below
    cache.chmod(path, 0o400)
    cache.link(path, tmp_path / "linked")
    assert cache.sha256(path) == cache.sha256(tmp_path / "linked") == "trusted"
    os.chmod(path, 0o600)
    path.write_bytes(b"changed")
    cache.chmod(path, 0o400)
    assert cache.sha256(tmp_path / "linked") == sha256_file(path) != "trusted"


def test_atomic_json_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "meta.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert target.read_text().count('"a": 2') == 1
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_kvm_speed_probe_agrees_with_the_kvm_kind() -> None:
    from forkd.vmm.kvm_speed import probe_speed

    kvm = probe_kvm()
    if not kvm.present:
        pytest.skip("no usable /dev/kvm on this host")
    hardware_speed, detail = probe_speed()
    assert "iterations/s" in detail or "did not finish" in detail, detail
    if kvm.pvm:
        assert hardware_speed is False, f"PVM ran ring-0 code at hardware speed? {detail}"


def test_the_machine_alias_is_pinned_to_its_versioned_type(tmp_path: Path) -> None:
    """A QEMU whose q35 moved to 8.2 gives pc-q35-8.2; the identity never records the bare alias."""
    fake = tmp_path / "qemu-system-x86_64"
    fake.write_text("#!/bin/sh\ncat <<'END'\nSupported machines are:\n"
                    "q35                  Standard PC (Q35 + ICH9, 2009) (alias of pc-q35-8.2)\n"
                    "pc-q35-8.2           Standard PC (Q35 + ICH9, 2009)\nEND\n")
    fake.chmod(0o755)
    assert machine_type(str(fake)) == "pc-q35-8.2"


def test_the_tcg_cpu_is_a_versioned_model_without_cx16() -> None:
    assert cpu_model("tcg") == "Westmere-v1,-cx16" and cpu_model("kvm") == "host"
