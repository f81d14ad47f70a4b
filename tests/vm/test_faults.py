"""Faults on real guests: daemon and VMM killed with SIGKILL, a full disk, races on one tag, many cycles.

These tests run their own daemon processes on their own FORKD_HOME (they kill them), not the shared
session daemon. The guest image comes from FORKD_CACHE like every VM test.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import vmm_processes_under

from forkd.sdk.controller import Controller, DaemonUnreachable, ForkdError

pytestmark = pytest.mark.vm
TAG = "faults"
START_TIMEOUT_S = 60.0
RELEASE_BOUND_S = 60.0  # a bounded wait for release; the measured time is printed, not asserted


class Daemon:
    """A real ``forkd daemon`` process on ``home`` that a test may SIGKILL and start again."""

    def __init__(self, home: Path, *args: str) -> None:
        self.home = home
        self.args = args
        self.env = {**os.environ, "FORKD_HOME": str(home), "FORKD_SOCKET": str(home / "forkd.sock")}
        self.env.pop("FORKD_URL", None)
        self.process: subprocess.Popen[bytes] | None = None
        self.controller = Controller(url=f"unix://{home / 'forkd.sock'}")

    def start(self, *extra: str) -> Daemon:
        log = open(self.home / "daemon.log", "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "forkd", "daemon", *self.args, *extra],
                                        env=self.env, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.controller.health()
                return self
            except DaemonUnreachable:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"daemon did not start: {self.log_tail()}") from None
                time.sleep(0.1)

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self) -> str:
        return (self.home / "daemon.log").read_text(errors="replace")[-3000:]


def _sockets_under(home: Path) -> list[str]:
    """The sockets under ``home`` but the daemon's own; a directory removed while it is walked (a sandbox
    the daemon is cleaning up) is skipped, as os.walk skips what it cannot list."""
    return sorted(os.path.relpath(os.path.join(parent, name), home)
                  for parent, _, names in os.walk(home) for name in names
                  if name.endswith(".sock") and name != "forkd.sock")


def record_ids(home: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{home / 'state.db'}?mode=ro", uri=True)) as db:
        return sorted(row[0] for row in db.execute("SELECT id FROM sandboxes"))


def host_state(home: Path) -> dict[str, object]:
    """What a leak would show: VMM processes, run directories, sockets, sandbox records."""
    records = record_ids(home)
    sandboxes = home / "sandboxes"
    return {
        "vmms": len(vmm_processes_under(home)),
        "run_dirs": sorted(p.name for p in sandboxes.iterdir()) if sandboxes.exists() else [],
        "sockets": _sockets_under(home),
        "records": records,
    }


def wait_until(predicate, bound_s: float = RELEASE_BOUND_S, step_s: float = 0.01) -> float:
    """Seconds until ``predicate()`` held; fails after ``bound_s``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > bound_s:
            raise AssertionError(f"condition not reached within {bound_s} s")
        time.sleep(step_s)
    return time.monotonic() - started


def running_records(home: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{home / 'state.db'}?mode=ro", uri=True)) as db:
        return db.execute("SELECT count(*) FROM sandboxes WHERE status = 'running'").fetchone()[0]


def own_home(prefix: str) -> Iterator[Path]:
    """A FORKD_HOME for one test module; any VMM left under it is killed at the end."""
    if os.geteuid() != 0:
        pytest.fail("VM tests need root")
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    yield home
    for pid in vmm_processes_under(home):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not os.environ.get("FORKD_KEEP_TEST_HOME"):
        shutil.rmtree(home, ignore_errors=True)


def bake(home: Path, tag: str, **options: object) -> str:
    """One snapshot on ``home``, baked by a daemon that is then stopped."""
    daemon = Daemon(home).start()
    try:
        daemon.controller.build_image(name="default")
        daemon.controller.create_snapshot(tag, **options)
    finally:
        daemon.stop()
    return tag


@pytest.fixture(scope="module")
def fault_home() -> Iterator[Path]:
    yield from own_home("forkd-faults-")


@pytest.fixture(scope="module")
def fault_snapshot(fault_home: Path) -> str:
    return bake(fault_home, TAG, memory_mib=512, warm_modules=[])


def serving(home: Path) -> Iterator[Daemon]:
    """A fresh daemon on ``home``; whatever the test leaves is killed when it stops, and none may be left."""
    running = Daemon(home).start()
    yield running
    if running.process is not None and running.process.poll() is not None:
        running.start()  # the test SIGKILLed it: a new one reaps what is left, then stops
    running.stop()
    assert host_state(home)["vmms"] == 0, running.log_tail()


@pytest.fixture
def daemon(fault_home: Path, fault_snapshot: str) -> Iterator[Daemon]:
    yield from serving(fault_home)


def test_daemon_sigkill_during_fork_readopts_survivors(daemon: Daemon, fault_home: Path) -> None:
    client = daemon.controller
    before = host_state(fault_home)
    outcome: dict[str, object] = {}

    def fork() -> None:
        try:
            outcome["result"] = Controller(url=client.url).fork(TAG, 10)
        except ForkdError as exc:
            outcome["error"] = exc

    forking = threading.Thread(target=fork)
    forking.start()
    # Kill the daemon while the batch is still being restored: some children answer, others not yet.
    wait_until(lambda: running_records(fault_home) >= 3 or not forking.is_alive(), bound_s=300)
    daemon.kill9()
    forking.join(timeout=60)
    during = "result" not in outcome
    left = host_state(fault_home)
    print(f"\nSIGKILL {'during' if during else 'after'} the fork: {left['vmms']} VMMs and "
          f"{len(left['run_dirs'])} run directories left, {running_records(fault_home)} records running")

    daemon.start()
    adopted = client.sandboxes()
    ids = sorted(s["id"] for s in adopted)
    assert all("readopted_at" in s for s in adopted)
    for sandbox_id in ids:
        assert client.ping(sandbox_id)
        assert client.exec(sandbox_id, "echo alive")["stdout"] == "alive\n"
    after = host_state(fault_home)
    assert after["vmms"] == len(ids), "every VMM left running is either re-adopted or reaped"
    assert after["run_dirs"] == ids and after["records"] == ids
    assert after["sockets"] == sorted(f"sandboxes/{i}/{s}" for i in ids for s in ("agent.sock", "qmp.sock"))
    print(f"re-adopted {len(ids)} of {left['vmms']} VMMs")
    assert ids, "children that answered before the daemon died must be re-adopted"

    # An adopted VMM is watched through its pidfd: killed from outside, it is released.
    victim = next(s for s in adopted)
    os.kill(victim["pid"], signal.SIGKILL)
    took = wait_until(lambda: not (fault_home / "sandboxes" / victim["id"]).exists()
                      and victim["id"] not in [s["id"] for s in client.sandboxes()])
    print(f"adopted VMM killed from outside: released after {took * 1000:.0f} ms")
    for sandbox_id in ids:
        if sandbox_id != victim["id"]:
            client.kill(sandbox_id)
    assert host_state(fault_home) == before


def qmp_status(monitor: Path) -> str:
    """The run state a QEMU monitor reports (no daemon holds the socket: it was killed)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(monitor))
        stream = sock.makefile("rwb")
        json.loads(stream.readline())  # the greeting
        for command in ("qmp_capabilities", "query-status"):
            stream.write(json.dumps({"execute": command}).encode() + b"\n")
            stream.flush()
            while "return" not in (answer := json.loads(stream.readline())):  # events come first
                assert "error" not in answer, answer
    return answer["return"]["status"]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_daemon_sigkill_in_a_branch_pause_leaves_the_source_running(daemon: Daemon, fault_home: Path) -> None:
    """SIGKILL while BRANCH has its source stopped: the device state is written in the pause and the
    private pages (here ~256 MiB of them) are read after it, so the kill lands inside the pause. The
    next daemon resumes the source instead of reaping it; the branch is failed and the source is not
    branched again."""
    client = daemon.controller
    [source] = client.fork(TAG, 1)["sandboxes"]
    sandbox_id = source["id"]
    client.run_code(sandbox_id, "ballast = bytearray(b'\\x01') * (256 << 20); kept = 'alive'")
    # wait=False answers only after the pause, so the BRANCH is asked from a thread and the kill is timed
    # by the build's files; the answer never comes (the daemon dies first).
    branching = concurrent.futures.ThreadPoolExecutor(1)
    branching.submit(client.branch, sandbox_id, "crashed", mode="diff", wait=False)
    builds = fault_home / "snapshots"
    # The daemon creates the state file before the pause (QEMU gets it as a descriptor); it fills in the pause.
    wait_until(lambda: any(_size(d / "state") > 0 for d in builds.glob(".build-crashed-*")), bound_s=120,
               step_s=0.001)
    daemon.kill9()
    branching.shutdown(wait=True)
    status = qmp_status(fault_home / "sandboxes" / sandbox_id / "qmp.sock")
    assert status == "paused", "the kill came after the pause: this run proves nothing"
    daemon.start()
    assert [s["id"] for s in client.sandboxes()] == [sandbox_id]
    assert client.eval(sandbox_id, "kept")["value_json"] == "alive"
    assert client.exec(sandbox_id, "echo running")["stdout"] == "running\n"
    assert client.snapshot("crashed")["status"] == "failed"
    assert not list(builds.glob(".build-crashed-*"))
    with pytest.raises(ForkdError, match="stopped while branching"):
        client.branch(sandbox_id, "again")
    client.kill(sandbox_id)
    client.remove_snapshot("crashed")


def test_daemon_sigkill_after_fork_then_restart(daemon: Daemon, fault_home: Path) -> None:
    client = daemon.controller
    forked = client.fork(TAG, 3)
    assert forked["errors"] == []
    ids = sorted(s["id"] for s in forked["sandboxes"])
    client.run_code(ids[0], "kept = 'state survives the daemon'")
    daemon.kill9()
    daemon.start()
    assert sorted(s["id"] for s in client.sandboxes()) == ids
    assert client.eval(ids[0], "kept")["value_json"] == "state survives the daemon"
    # A VMM that stops answering while the daemon is down is reaped on the next start.
    daemon.kill9()
    pids = {s["id"]: s["pid"] for s in forked["sandboxes"]}
    os.kill(pids[ids[1]], signal.SIGSTOP)
    daemon.start()
    assert sorted(s["id"] for s in client.sandboxes()) == [ids[0], ids[2]]
    assert host_state(fault_home)["run_dirs"] == [ids[0], ids[2]]
    for sandbox_id in (ids[0], ids[2]):
        client.kill(sandbox_id)


def test_stop_with_keep_on_stop_leaves_vmms_for_the_next_daemon(daemon: Daemon, fault_home: Path) -> None:
    daemon.stop()
    keeping = Daemon(fault_home, "--keep-sandboxes-on-stop").start()
    forked = keeping.controller.fork(TAG, 2)
    ids = sorted(s["id"] for s in forked["sandboxes"])
    keeping.stop()  # SIGTERM: the daemon exits, its VMMs do not
    assert keeping.process is not None and keeping.process.returncode is not None
    assert sorted(Path(f"/proc/{s['pid']}").exists() for s in forked["sandboxes"]) == [True, True]
    daemon.start()  # the default policy again: re-adopts, and kills them when it stops
    assert sorted(s["id"] for s in daemon.controller.sandboxes()) == ids
    assert all(daemon.controller.exec(i, "echo back")["stdout"] == "back\n" for i in ids)


def test_vmm_sigkill_is_released_promptly(daemon: Daemon, fault_home: Path) -> None:
    client = daemon.controller
    before = host_state(fault_home)
    timings = []
    for child in client.fork(TAG, 3)["sandboxes"]:
        os.kill(child["pid"], signal.SIGKILL)
        # The record goes last, after the run directory: wait for it, or the check below races the release.
        # Polled by the record alone: scanning every process each step would take a core from the daemon.
        timings.append(wait_until(lambda: child["id"] not in record_ids(fault_home), step_s=0.005))
    print(f"\nVMM SIGKILL → sandbox released after {', '.join(f'{t * 1000:.0f}' for t in timings)} ms")
    assert host_state(fault_home) == before


def test_daemon_sigkill_during_snapshot_create_leaves_nothing(daemon: Daemon, fault_home: Path) -> None:
    client = daemon.controller
    progress: list[str] = []

    def create() -> None:
        with contextlib.suppress(ForkdError):
            Controller(url=client.url).create_snapshot("half", on_progress=progress.append, memory_mib=256,
                                                       warm_modules=[])

    creating = threading.Thread(target=create)
    creating.start()
    wait_until(lambda: any("booting parent" in line for line in progress), bound_s=120)
    wait_until(lambda: len(vmm_processes_under(fault_home / "snapshots")) == 1, bound_s=60)
    daemon.kill9()
    creating.join(timeout=60)
    assert [p.name for p in (fault_home / "snapshots").glob(".build-half-*")], "the build was under way"
    daemon.start()
    assert not list((fault_home / "snapshots").glob(".build-*"))
    assert not (fault_home / "snapshots" / "half").exists()
    assert "half" not in [s["tag"] for s in client.snapshots()]
    assert vmm_processes_under(fault_home / "snapshots") == []


def test_failed_child_does_not_fail_its_batch(fault_home: Path, fault_snapshot: str) -> None:
    limited = Daemon(fault_home, "--max-sandboxes", "2").start()
    try:
        result = limited.controller.fork(TAG, 3)
        assert len(result["sandboxes"]) == 2 and len(result["errors"]) == 1
        assert result["errors"][0]["code"] == "busy" and "max_sandboxes" in result["errors"][0]["message"]
        for child in result["sandboxes"]:
            assert limited.controller.exec(child["id"], "echo ok")["stdout"] == "ok\n"
    finally:
        limited.stop()
    assert host_state(fault_home)["vmms"] == 0


def test_concurrent_requests_on_one_tag(daemon: Daemon, fault_home: Path) -> None:
    client = daemon.controller
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        def create() -> dict | ForkdError:
            try:
                return Controller(url=client.url).create_snapshot("race", memory_mib=256, warm_modules=[])
            except ForkdError as exc:
                return exc

        first, second = pool.submit(create), pool.submit(create)
        losers = [f.result() for f in (first, second) if isinstance(f.result(), ForkdError)]
        assert len(losers) == 1 and losers[0].status == 409, losers
        # (both futures are done: the loser is refused at once, the winner after baking)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        creating = pool.submit(lambda: Controller(url=client.url).create_snapshot("race2", memory_mib=256,
                                                                                  warm_modules=[]))
        wait_until(lambda: list((fault_home / "snapshots").glob(".build-race2-*")), bound_s=60)
        with pytest.raises(ForkdError) as early:
            client.fork("race2", 1)
        assert early.value.status == 409 and "being created" in early.value.message
        creating.result(timeout=600)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        forking = pool.submit(lambda: Controller(url=client.url).fork("race", 2))
        time.sleep(0.05)
        removing = pool.submit(lambda: Controller(url=client.url).remove_snapshot("race"))
        try:
            forked = forking.result(timeout=300)
        except ForkdError as exc:
            forked = exc
        try:
            removed = removing.result(timeout=60)
        except ForkdError as exc:
            removed = exc
    if isinstance(removed, ForkdError):  # the fork won: rmi is refused while children start or run
        assert removed.status == 409
        assert isinstance(forked, dict) and len(forked["sandboxes"]) == 2
        for child in forked["sandboxes"]:
            assert client.ping(child["id"])
            client.kill(child["id"])
        client.remove_snapshot("race")
    else:  # rmi won before the fork counted: the fork is refused and no child exists
        assert isinstance(forked, ForkdError), forked
    assert not (fault_home / "snapshots" / "race").exists()
    client.remove_snapshot("race2")
    assert host_state(fault_home)["vmms"] == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)  # each cycle restores, reseeds and releases a child under TCG: seconds
def test_many_spawn_kill_cycles_leave_the_host_as_it_was(daemon: Daemon, fault_home: Path) -> None:
    cycles = int(os.environ.get("FORKD_SPAWN_CYCLES", "100"))
    client = daemon.controller
    assert daemon.process is not None
    fds_before = daemon_descriptors(daemon.process.pid)
    before = host_state(fault_home)
    started = time.monotonic()
    for _ in range(cycles):
        forked = client.fork(TAG, 1)
        assert forked["errors"] == []
        client.kill(forked["sandboxes"][0]["id"])
    took = time.monotonic() - started
    print(f"\n{cycles} spawn/kill cycles in {took:.1f} s ({took / cycles * 1000:.0f} ms each)")
    assert host_state(fault_home) == before
    fds_after = daemon_descriptors(daemon.process.pid)
    assert fds_after["other"] <= fds_before["other"] + 2, f"daemon file descriptors grew: {fds_before} -> {fds_after}"
    threads = len(os.listdir(f"/proc/{daemon.process.pid}/task"))
    assert fds_after["database"] <= 2 * threads, f"more database files open than threads: {fds_after}, {threads}"


def daemon_descriptors(pid: int) -> dict[str, int]:
    """The daemon's open descriptors: its registry files (one connection, database + log, per
    thread that used it: bounded by its thread pools) and everything else (must not grow)."""
    counts = {"database": 0, "other": 0}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed while listing
            continue
        counts["database" if target.endswith(("state.db", "state.db-wal")) else "other"] += 1
    return counts


def test_disk_full_during_snapshot_registers_nothing(fault_snapshot: str) -> None:
    home = Path(tempfile.mkdtemp(prefix="forkd-full-", dir="/var/tmp"))
    snapshots = home / "snapshots"
    snapshots.mkdir()
    # Room for the image files copied in (another filesystem than the cache) and the preflight's
    # estimate, so the build starts; then the disk is filled while the parent boots.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1400m", "tmpfs", str(snapshots)], check=True)
    # A floor the 1400 MiB tmpfs can keep while it builds; the file lives outside home, since a process
    # whose command line names home counts as a VMM left behind below (the daemon's would).
    config = Path(tempfile.mkstemp(prefix="forkd-floor-", suffix=".toml", dir="/var/tmp")[1])
    config.write_text("[disk]\nmin_free_mib = 16\n")
    full = Daemon(home, "--config", str(config))
    try:
        full.start()
        client = full.controller
        filler = snapshots / "filler"

        def fill(line: str) -> None:
            if "booting parent" in line and not filler.exists():
                chunk = b"\xff" * (1 << 20)
                with open(filler, "wb", buffering=0) as f:
                    with contextlib.suppress(OSError):  # ENOSPC: the disk is full
                        while True:
                            f.write(chunk)

        with pytest.raises(ForkdError) as failed:
            client.create_snapshot("full", on_progress=fill, memory_mib=256, warm_modules=[])
        print(f"\nfull disk during the build: {failed.value.message}")
        assert failed.value.code == "disk_full" and "disk full" in failed.value.message, failed.value.message
        assert client.snapshots() == []
        assert sorted(p.name for p in snapshots.iterdir()) == ["filler"]
        assert vmm_processes_under(home) == []
        filler.unlink()
        # Too little room from the start: refused before anything is written.
        subprocess.run(["mount", "-o", "remount,size=64m", str(snapshots)], check=True)
        with pytest.raises(ForkdError) as refused:
            client.create_snapshot("tiny", memory_mib=256, warm_modules=[])
        assert refused.value.status == 507 or refused.value.code == "disk_full", refused.value.message
        assert "disk full" in refused.value.message
        assert list(snapshots.iterdir()) == [] and client.snapshots() == []
    finally:
        full.stop()
        subprocess.run(["umount", str(snapshots)], check=False)
        shutil.rmtree(home, ignore_errors=True)
        config.unlink(missing_ok=True)
