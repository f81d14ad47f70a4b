"""A VMM's jail (vmm/jail.py) with real namespaces: the process the daemon starts is pid 1 of its own pid
namespace and the daemon holds its host pid; its root holds only the system, its own run directory and
the files declared for it, pins no network namespace, and a root that cannot be built fails the start
leaving nothing behind; its rlimits are set; its uid is given back when it exits; and a host that
cannot jail VMMs is refused, saying how to fix it or opt out."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import short_tmp_dir
from forkd.host.doctor import _jail as doctor_jail_check
from forkd.vmm import jail as jail_module
from forkd.vmm.backends import BackendOptions, create_vmm
from forkd.vmm.jail import HostFile, Jail, JailSettings, JailUnavailable
from forkd.vmm.base import BootSpec, VmmError
from forkd.vmm.qemu_disk import backing_chain, create_overlay, qemu_img
from forkd.vmm.qemu_machine import QemuMachine, jailed_argv
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
    assert "cannot touch '/etc/cron.d/fkd-jail-probe'" in out and not Path("/etc/cron.d/fkd-jail-probe").exists()
    assert int(status["Uid"].split()[0]) in range(1900065000, 1900065002)
    assert returncode == -9 and jail.uids.held() == {}  # its uid is free again


def _run_jailed(jail: Jail, home: Path, script: str, files: list[HostFile]) -> str:
    """``script`` run as a jailed uid in ``sb-mine`` with ``files``; what it printed."""
    async def scenario() -> str:
        with open(home / "out", "wb") as out:
            process = await jail.spawn(lambda uid: _drop(uid, "sh", "-c", script), ("setuid", "setgid"),
                                       home / "sandboxes" / "sb-mine", out, files=files)
        await asyncio.wait_for(process.wait(), 30)
        return (home / "out").read_text()
    return asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_jailed_process_sees_only_its_planned_root(home: Path) -> None:
    snapshot = home / "snapshots" / "tag"
    snapshot.mkdir(parents=True)
    for name in ("memory", "disk.qcow2", "state"):
        (snapshot / name).write_text(name)
        (snapshot / name).chmod(0o666)
    (home / "state.db").write_text("secret")
    (home / "state.db").chmod(0o644)
    files = [HostFile(snapshot / "memory", writable=True), HostFile(snapshot / "disk.qcow2")]
    script = (f"ls -A /; echo --; ls -A /dev; echo --; ls -A {home}; echo --; ls -A {snapshot}; echo --; "
              f"cat {snapshot}/disk.qcow2; echo; echo --; "
              f"echo more >> {snapshot}/memory; echo more >> {snapshot}/disk.qcow2; touch /probe 2>&1; "
              f"for p in /etc/shadow /etc/passwd /root /home /var {home}/state.db {snapshot}/state; do "
              "test -e $p && echo visible $p; done; echo --")
    out = _run_jailed(Jail(JailSettings(uid_range=UIDS)), home, script, files)
    top, dev, forkd_home, own, read, wrote, _ = (part.split() for part in out.split("--\n"))
    assert set(top) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc",
                        home.parts[1]}, top  # nothing else of the host's tree
    assert dev == ["null", "random", "urandom", "zero"]
    assert forkd_home == ["sandboxes", "snapshots"]  # of forkd's home, only where its files are
    assert own == ["disk.qcow2", "memory"] and read == ["disk.qcow2"]  # its own files, readable
    assert "visible" not in wrote and "Read-only file system" in out, out
    assert (snapshot / "memory").read_text() == "memorymore\n"  # writable when declared so ...
    assert (snapshot / "disk.qcow2").read_text() == "disk.qcow2"  # ... read-only otherwise
    assert not Path("/probe").exists()


def test_a_root_that_cannot_be_built_fails_the_start_naming_the_file_and_leaves_nothing(home: Path) -> None:
    jail = Jail(JailSettings(uid_range=UIDS))
    mounts = Path("/proc/self/mountinfo").read_text()
    missing = home / "snapshots" / "gone" / "memory"
    with pytest.raises(VmmError, match=rf"{missing} cannot be bound into the VMM's root: No such file"):
        _run_jailed(jail, home, "true", [HostFile(missing, writable=True)])
    assert Path("/proc/self/mountinfo").read_text() == mounts and jail.uids.held() == {}
    assert _run_jailed(jail, home, "ls -A /dev", []).split() == ["null", "random", "urandom", "zero"]


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


def test_a_childs_machine_declares_its_whole_disk_chain_and_its_memory_file(tmp_path: Path) -> None:
    """What the jail binds for a child of a branch: every file QEMU opens through its overlay, named as QEMU
    names them (a relative ``../tag/disk.qcow2`` taken next to the layer recording it), and the memory file."""
    base, branch, run = tmp_path / "snapshots" / "base", tmp_path / "snapshots" / "branch", tmp_path / "sb"
    for directory in (base, branch, run):
        directory.mkdir(parents=True)
    (base / "base.ext4").write_bytes(bytes(1 << 20))

    async def layers() -> None:
        await create_overlay(base / "base.ext4", base / "disk.qcow2", "raw", relative=True)
        await qemu_img("create", "-q", "-f", "qcow2", "-b", "../base/disk.qcow2", "-F", "qcow2",
                       str(branch / "disk.qcow2"))
        await create_overlay(branch / "disk.qcow2", run / "disk.qcow2", "qcow2")
    asyncio.run(layers())
    chain = backing_chain(run / "disk.qcow2")
    assert chain == [branch / "disk.qcow2", base / "disk.qcow2", base / "base.ext4"]
    spec = BootSpec(base / "vmlinuz", base / "initrd.img", "", 512, 1, "", "")
    machine = QemuMachine("qemu-system-x86_64", "tcg", "qemu64", huge_pages=True)
    assert machine.host_files(spec, chain, base / "memory", share=False) == (
        *(HostFile(layer) for layer in chain), HostFile(base / "memory", writable=True))
    assert HostFile(base / "vmlinuz") in machine.host_files(spec, chain, base / "memory", share=True)  # a boot


def test_the_hosts_network_namespaces_are_let_go_in_one_detach(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One detach per namespace file cost an RCU grace period each on the thread that starts every VMM, so
    a VMM start slowed down with every sandbox alive: the host's tree, ``/run/netns`` in it, goes as a whole."""
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
    assert len(detached) == 1  # ... by one detach, not five


def test_a_start_its_caller_gave_up_on_is_killed_and_only_then_frees_its_uid(home: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork cancelled (or a daemon stopping) while the jail's thread starts its VMM: the process it starts
    anyway is killed, not left running unknown to anyone, and its uid is not handed out while it runs."""
    jail = Jail(JailSettings(uid_range=UIDS))
    real_start = jail._start
    monkeypatch.setattr(jail, "_start", lambda *args: (time.sleep(0.5), real_start(*args))[1])

    def running_as_jailed_uid() -> list[int]:
        found = []
        for status in Path("/proc").glob("[0-9]*/status"):
            with contextlib.suppress(OSError):
                uid = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("Uid:"))
                if uid in range(1900065000, 1900065002):
                    found.append(int(status.parent.name))
        return found

    async def scenario() -> tuple[list[int], dict[int, tuple[int, int]]]:
        with open(home / "out", "wb") as out:  # open throughout: the start can complete after the cancel
            spawn = asyncio.ensure_future(jail.spawn(lambda uid: _drop(uid, "sleep", "30"), ("setuid", "setgid"),
                                                     home / "sandboxes" / "sb-mine", out))
            await asyncio.sleep(0.1)  # the thread is starting it
            spawn.cancel()
            with pytest.raises(asyncio.CancelledError):
                await spawn
            await asyncio.sleep(1.0)  # the thread has started it by now
            for _ in range(100):  # killed and reaped, its uid given back
                await asyncio.sleep(0.05)
                if not jail.uids.held() and not running_as_jailed_uid():
                    break
            return running_as_jailed_uid(), jail.uids.held()

    running, held = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert running == [] and held == {}
