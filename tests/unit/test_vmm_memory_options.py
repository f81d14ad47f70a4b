"""What shrinks a child's VMM: transparent huge pages off for every VMM, as the daemon's config says."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from forkd.daemon.config import load_config
from forkd.vmm import qemu_machine
from forkd.vmm.backends import BackendOptions, create_vmm
from forkd.vmm.qemu import QemuVmm


def _thp_of_a_new_process() -> str:
    """``THP_enabled`` of a process started now (as a VMM is: it inherits the flag across exec)."""
    status = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True, check=True).stdout
    return next(line.split()[1] for line in status.splitlines() if line.startswith("THP_enabled:"))


def _set_thp_disable(value: int) -> None:
    import ctypes
    assert ctypes.CDLL(None).prctl(qemu_machine.PR_SET_THP_DISABLE, value, 0, 0, 0) == 0


@pytest.fixture
def thp_restored() -> object:
    """Huge pages allowed again afterwards: the flag is this test process's own."""
    _set_thp_disable(0)
    yield
    _set_thp_disable(0)


def test_vmms_start_without_transparent_huge_pages(thp_restored: object) -> None:
    """A huge page QEMU advises (translation buffer, ACPI tables) is private as a whole: 2-4 MiB a child."""
    assert _thp_of_a_new_process() == "1"
    QemuVmm(accelerator="tcg")
    assert _thp_of_a_new_process() == "0"


def test_huge_pages_stay_when_the_config_allows_them(tmp_path: Path, thp_restored: object) -> None:
    file = tmp_path / "forkd.toml"
    file.write_text("vmm_huge_pages = true\n")
    options = load_config(file, env={}).backend_options
    assert options == BackendOptions(vmm_huge_pages=True)
    create_vmm("qemu", BackendOptions(accelerator="tcg", vmm_huge_pages=True))
    assert _thp_of_a_new_process() == "1"
    assert load_config(None, env={}).backend_options.vmm_huge_pages is False
