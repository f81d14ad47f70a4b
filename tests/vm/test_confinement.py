"""Each QEMU VMM in its jail (vmm/jail.py), seen from the host on real children of a real daemon: its own
non-root uid and gid, no capabilities, its own pid and mount namespaces (pid 1 there, the daemon's record
holding its host pid), its rlimits, a root of its own holding only the system, its own files and run
directory (not the daemon's state, not the host's /etc), and no write to host paths."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller
from forkd.vmm.jail import DEFAULT_MAX_FILE_SIZE_MIB, DEFAULT_MAX_OPEN_FILES
from forkd.vmm.vmm_uids import DEFAULT_UID_RANGE, UidRange

pytestmark = pytest.mark.vm


#: What a VMM's root holds at its top besides the first directory of forkd's home (vmm/jail.py).
SYSTEM_TOP = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc"}


def _inside(path: Path) -> str:
    """``path`` relative to a root: to look it up under ``/proc/PID/root``."""
    return str(path).lstrip("/")


def _status(pid: int) -> dict[str, str]:
    return {k: v.strip() for k, v in (line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())}


def _limit(pid: int, name: str) -> list[str]:
    line = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines() if line.startswith(name))
    return line[len(name):].split()[:2]


def _in_mounts_of(pid: int, *command: str) -> subprocess.CompletedProcess[str]:
    """``command`` in the VMM's mount namespace (as root): what is there to see."""
    return subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", *command],
                          capture_output=True, text=True, timeout=30)


def _as_vmm(pid: int, uid: int, *command: str) -> subprocess.CompletedProcess[str]:
    """``command`` as the VMM's uid and gid, in its mount namespace: what the VMM itself could do."""
    return _in_mounts_of(pid, "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command)


def test_each_vmm_runs_jailed(daemon: Controller, children: list[str], forkd_home: Path) -> None:
    records = [daemon.sandbox(sandbox_id) for sandbox_id in children[:2]]
    uids = []
    for record in records:
        pid = record["pid"]
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"qemu-system-x86_64")
        status = _status(pid)
        real, effective, saved, filesystem = (int(x) for x in status["Uid"].split())
        assert real != 0 and real == effective == saved == filesystem
        assert real in UidRange.parse(DEFAULT_UID_RANGE)
        assert [int(x) for x in status["Gid"].split()] == [real] * 4 and status["Groups"] == str(real)
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == 0
        assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
        # pid 1 of a pid namespace of its own; the record holds its host pid. Its own mount namespace.
        assert status["NSpid"].split() == [str(pid), "1"]
        for namespace in ("pid", "mnt"):
            assert os.readlink(f"/proc/{pid}/ns/{namespace}") != os.readlink(f"/proc/self/ns/{namespace}")
        assert _limit(pid, "Max open files") == [str(DEFAULT_MAX_OPEN_FILES)] * 2
        assert _limit(pid, "Max file size") == [str(DEFAULT_MAX_FILE_SIZE_MIB << 20)] * 2
        # What it sees: of the sandboxes, only its own run directory; of the processes, only itself.
        seen = _in_mounts_of(pid, "ls", "-A", str(forkd_home / "sandboxes"))
        assert seen.stdout.split() == [record["id"]], seen
        procs = _as_vmm(pid, real, "sh", "-c", "ls /proc | grep -c '^[0-9]'")
        assert int(procs.stdout) <= 3, procs  # sh, ls and grep: no QEMU, no daemon, no host process
        # Its root is its own (what /proc/PID/root shows): the system read-only, its run directory, and of
        # forkd's home only the snapshot files its command line names; not the daemon's state, not /etc/cron.d.
        root = Path(f"/proc/{pid}/root")
        assert set(os.listdir(root)) <= SYSTEM_TOP | {forkd_home.parts[1]}, os.listdir(root)
        assert sorted(os.listdir(root / _inside(forkd_home))) == ["sandboxes", "snapshots"]
        assert {"qmp.sock", "agent.sock"} <= set(os.listdir(root / _inside(forkd_home / "sandboxes" / record["id"])))
        for hidden in (forkd_home / "state.db", Path("/etc/cron.d"), Path("/etc/shadow"), Path("/root")):
            assert hidden.exists()  # there on the host ...
            assert not (root / _inside(hidden)).exists()  # ... not in the VMM's root
        # It cannot write the host: no cron job, no file in the daemon's state.
        for target in ("/etc/cron.d/forkd-probe", str(forkd_home / "forkd-probe")):
            wrote = _as_vmm(pid, real, "touch", target)
            assert wrote.returncode != 0 and wrote.stderr, wrote
            assert not Path(target).exists()
        uids.append(real)
    assert len(set(uids)) == 2  # one uid each
    # The jailed children still work.
    for sandbox_id in children:
        assert daemon.exec(sandbox_id, ["true"])["exit_code"] == 0
