"""The systemd unit's sandboxing leaves the daemon able to do its work.

systemd is not PID 1 on the machines the tests run on, so the settings cannot be tried with
``systemd-run -p``; instead each setting known to break a daemon duty is checked against that duty.
"""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "packaging" / "systemd" / "forkd.service"


@pytest.fixture(scope="module")
def service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNIT)
    return parser["Service"]


def test_setuid_files_of_guest_trees_can_be_created(service: configparser.SectionProxy) -> None:
    # RestrictSUIDSGID=yes makes chmod/fchmodat/open(O_CREAT)/mknod with S_ISUID or S_ISGID fail
    # with EPERM (systemd.exec(5)); a Debian minbase tree has such files (mount, passwd, chfn,
    # unix_chkpwd; checked in the cached bookworm minbase tree), so dpkg inside debootstrap and the
    # cached tree's `tar --preserve-permissions` extraction would fail.
    assert service.get("RestrictSUIDSGID", "no") == "no"


def test_state_written_private_and_roots_inside_writable_paths(service: configparser.SectionProxy) -> None:
    assert service["UMask"] == "0077"
    writable = service["ReadWritePaths"].split()
    # imports_dir and packs_dir default to HOME/imports and HOME/packs, under the state directory.
    assert "/var/lib/forkd" in writable and service["StateDirectory"] == "forkd"


def test_start_waits_for_the_socket_and_sandbox_cgroups_are_delegated(service: configparser.SectionProxy) -> None:
    assert service["Type"] == "notify"  # daemon/notify.py sends READY=1 once the socket serves
    assert service.get("NotifyAccess", "main") == "main"  # the daemon itself sends it, no helper process
    assert service["Delegate"] == "yes"


def test_exec_start_runs_what_setup_installs(service: configparser.SectionProxy) -> None:
    program = service["ExecStart"].split()[0]
    setup = (UNIT.parents[2] / "scripts" / "setup").read_text()
    assert f'ln -sfn "$PWD/.venv/bin/forkd" {program}' in setup
    assert service["ExecStart"].split()[1:] == ["daemon"]


def test_the_daemon_keeps_what_jailing_a_vmm_takes(service: configparser.SectionProxy) -> None:
    """vmm/jail.py: namespaces and mounts (SYS_ADMIN); QEMU's start until it drops to its uid (SETUID,
    SETGID, DAC_OVERRIDE: a child cannot have a capability the daemon's bounding set lacks); a VMM of another
    uid is not dumpable, so reading and writing its /proc/PID/mem and pagemap (diff layers, BRANCH) needs
    SYS_PTRACE."""
    bounding = set(service["CapabilityBoundingSet"].split())
    assert {"CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_DAC_OVERRIDE", "CAP_SYS_PTRACE"} <= bounding
    assert service.get("RestrictNamespaces", "no") == "no"
