"""The VMM uid allocator (vmm/vmm_uids.py): one uid per live VMM from a range, exhaustion named, a released
or dead holder's uid reused, and the holders a previous daemon left re-learned from /proc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forkd.vmm.base import VmmError
from forkd.vmm.process import start_time
from forkd.vmm.vmm_uids import DEFAULT_UID_RANGE, UidAllocator, UidRange, UidRangeError, host_conflicts, live_holders


def _alive(pid: int) -> int | None:
    return 100 + pid  # every pid "started" at 100+pid: holders recorded with that start time are alive


def test_the_range_is_parsed_and_privileged_ids_are_refused() -> None:
    assert UidRange.parse(" 5-7 ") == UidRange(5, 7) and len(UidRange(5, 7)) == 3 and 6 in UidRange(5, 7)
    for bad in ("0-10", "10-5", "x-y", "5", f"1-{1 << 32}"):
        with pytest.raises(UidRangeError):
            UidRange.parse(bad)


def test_each_live_vmm_gets_its_own_uid_until_the_range_is_exhausted() -> None:
    uids = UidAllocator(UidRange(10, 12), scan=lambda _ids: [], started=_alive)
    taken = [uids.allocate() for _ in range(3)]
    assert sorted(taken) == [10, 11, 12]
    for pid, uid in enumerate(taken, start=1):
        uids.bind(uid, pid)
    with pytest.raises(VmmError, match=r"every VMM uid of the range 10-12 \(3\) is held.*widen `uid_range`"):
        uids.allocate()
    uids.release(11)
    assert uids.allocate() == 11


def test_a_uid_whose_holder_died_is_taken_back_and_a_pending_one_never() -> None:
    starts = {1: 101, 2: 102}
    uids = UidAllocator(UidRange(10, 11), scan=lambda _ids: [], started=starts.get)
    first, second = uids.allocate(), uids.allocate()
    uids.bind(first, 1)  # second stays pending: its VMM is still being started
    with pytest.raises(VmmError):
        uids.allocate()
    del starts[1]  # its VMM exited without anyone releasing it (killed, daemon busy)
    assert uids.allocate() == first
    starts[1] = 999  # the pid was reused by another process: not the holder either
    uids.bind(second, 2)
    uids.release(first)
    assert uids.allocate() == first


def test_a_restarted_daemon_relearns_who_holds_which_uid() -> None:
    """Nothing is persisted: the first allocation reads the holders off the host (a VMM a previous daemon left)."""
    uids = UidAllocator(UidRange(10, 12), scan=lambda _ids: [(10, 7, 107), (12, 8, 108)], started=_alive)
    assert uids.allocate() == 11
    with pytest.raises(VmmError):
        uids.allocate()
    assert uids.held()[10] == (7, 107) and uids.held()[12] == (8, 108)


@pytest.mark.root("setpriv")
def test_live_holders_are_read_from_proc() -> None:
    """A real process running as a uid of the range is found with its start time, as recovery needs."""
    ids = UidRange.parse(DEFAULT_UID_RANGE)
    uid = ids.last
    process = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "30"])
    try:
        for _ in range(100):
            found = [h for h in live_holders(ids) if h[1] == process.pid]
            if found:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert found == [(uid, process.pid, start_time(process.pid))]
        assert UidAllocator(UidRange(uid, uid)).held() == {}  # learned lazily ...
        with pytest.raises(VmmError):
            UidAllocator(UidRange(uid, uid)).allocate()  # ... on the first allocation: the one uid is held
    finally:
        process.kill()
        process.wait()


def test_ids_the_host_already_uses_are_named(tmp_path: Path) -> None:
    (tmp_path / "passwd").write_text("root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n")
    (tmp_path / "group").write_text("root:x:0:\n")
    (tmp_path / "subuid").write_text("alice:100000:65536\n")
    assert host_conflicts(UidRange(100, 999), tmp_path) == []
    assert host_conflicts(UidRange(1000, 1000), tmp_path) == ["passwd entry 'alice' (1000)"]
    assert host_conflicts(UidRange(165535, 170000), tmp_path) == ["subuid range of 'alice' (100000-165535)"]
    assert host_conflicts(UidRange.parse(DEFAULT_UID_RANGE)) == []  # the default is free on this host


def test_daemons_sharing_a_host_never_hand_out_one_uid_twice(tmp_path: Path) -> None:
    """Each daemon claims its uids in one host-wide lock file: another daemon skips them (a cluster's nodes)."""
    claims = tmp_path / "run" / "vmm-uids.lock"
    mine = UidAllocator(UidRange(10, 12), scan=lambda _ids: [], started=_alive, claims=claims)
    assert mine.allocate() == 10
    script = ("import sys; from pathlib import Path; from forkd.vmm.vmm_uids import UidAllocator, UidRange; "
              "a = UidAllocator(UidRange(10, 12), scan=lambda _i: [], started=lambda p: 1, claims=Path(sys.argv[1])); "
              "print(a.allocate(), a.allocate())")
    other = subprocess.run([sys.executable, "-c", script, str(claims)], capture_output=True, text=True, timeout=60)
    assert other.stdout.split() == ["11", "12"], other.stderr  # 10 is this daemon's
    wider = subprocess.run([sys.executable, "-c", script.replace("UidRange(10, 12)", "UidRange(9, 12)"), str(claims)],
                           capture_output=True, text=True, timeout=60)
    assert wider.stdout.split() == ["9", "11"], wider.stderr  # another daemon's range overlapping this one's
    mine.release(10)
    other = subprocess.run([sys.executable, "-c", script, str(claims)], capture_output=True, text=True, timeout=60)
    assert other.stdout.split() == ["10", "11"], other.stderr
