"""A VMM's jail (vmm/jail.py) with real namespaces: the process the daemon starts is pid 1 of its own pid
namespace and the daemon holds its host pid; its mount namespace shows only its own run directory and
pins no network namespace; its rlimits are set; its uid is given back when it exits; and a host that
cannot jail VMMs is refused, saying how to fix it or opt out."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import short_tmp_dir
from forkd.host.doctor import _jail as doctor_jail_check
from forkd.vmm import jail as jail_module
from forkd.vmm.backends import BackendOptions, create_vmm
from forkd.vmm.jail import Jail, JailSettings, JailUnavailable
from forkd.vmm.qemu_machine import jailed_argv
from forkd.vmm.vmm_uids import UidRangeError

pytestmark = pytest.mark.root("setpriv", "prlimit", "ip")
UIDS = "1900065000-1900065001"


@pytest.fixture
def home() -> Iterator[Path]:
    with short_tmp_dir("fkd-jail-") as directory:
        directory.chmod(0o755)  # the jailed uid lists it below
        for name in ("sb-mine", "sb-sibling"):
            (directory / "sandboxes" / name).mkdir(parents=True)
        yield directory


def _drop(uid: int, *command: str) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]


def test_a_jailed_process_is_pid_1_of_its_own_namespaces_and_sees_only_its_run_dir(home: Path) -> None:
    netns = f"fkd-jail-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    jail = Jail(JailSettings(uid_range=UIDS, max_open_files=512, max_file_size_mib=64))
    script = (f"echo $$; ls -A {home}/sandboxes; ls /proc | grep -c '^[0-9]'; ulimit -n; ulimit -f; "
              "grep -c nsfs /proc/self/mountinfo; touch /etc/cron.d/fkd-jail-probe; exec sleep 30")

    async def scenario() -> tuple[str, dict[str, str], dict[str, str], int | None, dict[int, tuple[int, int]]]:
        with open(home / "out", "wb") as out:
            process = await jail.spawn(lambda uid: _drop(uid, "sh", "-c", script), ("setuid", "setgid"),
                                       home / "sandboxes" / "sb-mine", out)
        for _ in range(200):
            if (home / "out").read_text().count("\n") >= 7:
                break
            await asyncio.sleep(0.05)
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{process.pid}/status").read_text().splitlines())
        namespaces = {ns: os.readlink(f"/proc/{process.pid}/ns/{ns}") for ns in ("pid", "mnt")}
        held = jail.uids.held()
        process.kill()
        await asyncio.wait_for(process.wait(), 10)
        return (home / "out").read_text(), status, namespaces, process.returncode, held

    try:
        out, status, namespaces, returncode, held = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)
    lines = out.splitlines()
    assert lines[0] == "1"  # pid 1 inside ...
    pid = int(status["NSpid"].split()[0])
    assert status["NSpid"].split() == [str(pid), "1"]  # ... and the host pid is the one the daemon holds
    assert list(held.values()) == [(pid, held[int(status["Uid"].split()[0])][1])]
    for ns, seen in namespaces.items():
        assert seen != os.readlink(f"/proc/self/ns/{ns}")
    assert lines[1] == "sb-mine"  # the sibling's run directory is not there
    assert int(lines[2]) <= 3  # sh, ls, grep: no host process is visible to its uid
    assert lines[3:5] == ["512", str((64 << 20) // 512)]  # RLIMIT_NOFILE; RLIMIT_FSIZE in 512-byte blocks
    assert lines[5] == "0"  # no network namespace pinned by its mount namespace
    assert "Permission denied" in out and not Path("/etc/cron.d/fkd-jail-probe").exists()
    assert int(status["Uid"].split()[0]) in range(1900065000, 1900065002)
    assert returncode == -9 and jail.uids.held() == {}  # its uid is free again


def test_a_host_that_cannot_jail_is_refused_naming_the_fix_and_the_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jail_module.shutil, "which", lambda _name: None)
    with pytest.raises(JailUnavailable, match=r"`prlimit` is not installed.*`setpriv` is not installed.*"
                                              r"`enabled = false` under \[confinement\]"):
        create_vmm("qemu", BackendOptions(accelerator="tcg"))
    with pytest.raises(UidRangeError, match=r"uid range '0-10' must satisfy 0 < FIRST"):
        JailSettings(uid_range="0-10")
    assert doctor_jail_check().status == "fail"  # `forkd doctor` says so too
    opted_out = create_vmm("qemu", BackendOptions(accelerator="tcg", confinement=JailSettings(enabled=False)))
    assert opted_out.machine.jail is None  # type: ignore[attr-defined]


def test_a_uid_range_the_host_uses_is_refused() -> None:
    with pytest.raises(JailUnavailable, match=r"the uid range 1-65535 is in use on this host \(passwd entry"):
        Jail(JailSettings(uid_range="1-65535")).check()


def test_qemu_drops_to_its_uid_itself_and_keeps_its_disk_descriptor() -> None:
    argv = ["qemu", "-sandbox", "on,elevateprivileges=deny", "-drive", "file=d,format=qcow2", "-m", "1G"]
    assert jailed_argv(argv, 7) == ["qemu", "-sandbox", "on,obsolete=deny,elevateprivileges=allow,spawn=deny,"
                                    "resourcecontrol=deny", "-drive", "file=d,format=qcow2,auto-read-only=off",
                                    "-m", "1G", "-runas", "7:7"]


def test_the_hosts_network_namespaces_are_let_go_in_one_detach(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One detach per namespace file costs an RCU grace period each on the thread that starts every VMM, so
    a VMM start slowed down with every sandbox alive; ``/run/netns`` (a mount of its own) goes as a whole."""
    names = [f"fkd-pins-{secrets.token_hex(3)}" for _ in range(5)]
    detached: list[str] = []
    real_umount = jail_module._umount
    monkeypatch.setattr(jail_module, "_umount", lambda target: (detached.append(target), real_umount(target)))
    jail = Jail(JailSettings(uid_range=UIDS))

    async def scenario() -> str:
        with open(home / "out", "wb") as out:
            process = await jail.spawn(lambda uid: _drop(uid, "sh", "-c", "grep -c nsfs /proc/self/mountinfo"),
                                       ("setuid", "setgid"), home / "sandboxes" / "sb-mine", out)
        await asyncio.wait_for(process.wait(), 10)
        return (home / "out").read_text()

    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        out = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False)
    assert out.strip() == "0"  # none pinned ...
    assert detached == ["/run/netns"]  # ... by one detach, not five
