"""BRANCH of running guests and snapshot chains, through the real daemon, QEMU and guest agent."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import SUITE_MAX_CHAIN_DEPTH
from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.vm

# A process started before the branch: it rewrites a counter every 0.2 s until killed.
TICKER = ("(i=0; while true; do i=$((i+1)); echo $i > /tmp/ticks.new; mv /tmp/ticks.new /tmp/ticks; sleep 0.2; "
          "done) >/dev/null 2>&1 & echo $! > /tmp/ticker.pid")
ALIVE = "kill -0 $(cat /tmp/ticker.pid) && a=$(cat /tmp/ticks) && sleep 1 && b=$(cat /tmp/ticks) && [ $b -gt $a ] && echo ticking"


# A busy process: page i % PAGES of a 4 MiB buffer gets sha256(i) at step i, as fast as it can.
# The whole buffer is then a function of the step counter, so on SIGUSR1 the process checks every
# page against what the counter says (at the top of its loop, a consistent point) and reports.
BUSY = """
import hashlib, os, signal, time
PAGES, PAGE = 1024, 4096
buf = bytearray(PAGES * PAGE)
def fill(i):
    return hashlib.sha256(str(i).encode()).digest() * (PAGE // 32)
asked = False
def ask(*_):
    global asked
    asked = True
signal.signal(signal.SIGUSR1, ask)
with open("/tmp/busy.pid.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace("/tmp/busy.pid.tmp", "/tmp/busy.pid")  # only now may it be asked
i = 0
while True:
    if asked:
        asked = False
        bad = sum(buf[p * PAGE:(p + 1) * PAGE] != fill(i - (i - p) % PAGES) for p in range(PAGES)) if i >= PAGES else -1
        with open("/tmp/busy.tmp", "w") as f:
            f.write(f"{i} {bad} {hashlib.sha256(buf).hexdigest()}")
        os.replace("/tmp/busy.tmp", "/tmp/busy.check")
    i += 1
    buf[i % PAGES * PAGE:(i % PAGES + 1) * PAGE] = fill(i)
    if i % 256 == 0:
        time.sleep(0.01)  # leave the guest agent some of the one vCPU
"""
START_BUSY = ("nohup python3 /tmp/busy.py >/dev/null 2>&1 & "
              "for n in $(seq 600); do [ -e /tmp/busy.pid ] && exit 0; sleep 0.1; done; exit 1")
# Ask the busy process to check its buffer; print "steps bad-pages sha256" once it has (bounded).
CHECK_BUSY = ("rm -f /tmp/busy.check; kill -USR1 $(cat /tmp/busy.pid) && "
              "for n in $(seq 600); do [ -e /tmp/busy.check ] && cat /tmp/busy.check && exit 0; sleep 0.1; done; exit 1")


def busy_check(daemon: Controller, sandbox_id: str) -> tuple[int, int]:
    """(steps the busy process has made, pages of its buffer that do not match its counter)."""
    steps, bad, _digest = sh(daemon, sandbox_id, CHECK_BUSY).split()
    return int(steps), int(bad)


@pytest.fixture
def source(daemon: Controller, snapshot_tag: str) -> Iterator[str]:
    """One child of the session snapshot to branch from, killed after the test."""
    result = daemon.fork(snapshot_tag, 1)
    assert result["errors"] == []
    sandbox_id = result["sandboxes"][0]["id"]
    yield sandbox_id
    with contextlib.suppress(ForkdError):
        daemon.kill(sandbox_id)


@contextlib.contextmanager
def child_of(daemon: Controller, tag: str) -> Iterator[str]:
    result = daemon.fork(tag, 1)
    assert result["errors"] == [], result["errors"]
    sandbox_id = result["sandboxes"][0]["id"]
    try:
        yield sandbox_id
    finally:
        daemon.kill(sandbox_id)


def sh(daemon: Controller, sandbox_id: str, cmd: str) -> str:
    result = daemon.exec(sandbox_id, cmd, timeout_s=120)
    assert result["exit_code"] == 0, result
    return result["stdout"]


def has(daemon: Controller, sandbox_id: str, *paths: str) -> list[bool]:
    out = daemon.exec(sandbox_id, "; ".join(f"test -e {p} && echo y || echo n" for p in paths))["stdout"]
    return [line == "y" for line in out.split()]


@pytest.mark.parametrize("mode", ["diff", "full"])
def test_branch_keeps_processes_files_and_interpreter_state(daemon: Controller, snapshot_tag: str, source: str,
                                                            mode: str) -> None:
    tag = f"br-state-{mode}"
    sh(daemon, source, f"{TICKER}; echo ram > /tmp/before-ram; echo disk > /root/before-disk; sync")
    assert daemon.run_code(source, "kept = 41")["error"] is None
    info = daemon.branch(source, tag, mode=mode)
    try:
        assert info["status"] == "ready" and info["parent_tag"] == snapshot_tag
        assert info["memory_kind"] == mode and info["pause_ms"] > 0
        # The source goes on: same process, same files, new writes.
        assert sh(daemon, source, ALIVE) == "ticking\n"
        sh(daemon, source, "echo later > /tmp/after-branch")
        with child_of(daemon, tag) as child:
            assert sh(daemon, child, ALIVE) == "ticking\n"
            assert sh(daemon, child, "cat /tmp/before-ram /root/before-disk /tmp/warm-marker") == "ram\ndisk\nwarmed\n"
            assert has(daemon, child, "/tmp/after-branch") == [False]
            assert daemon.run_code(child, "kept + 1")["value"] == "42"
        with child_of(daemon, snapshot_tag) as sibling:  # the base snapshot never saw any of it
            assert has(daemon, sibling, "/tmp/before-ram", "/root/before-disk", "/tmp/ticker.pid") == [False] * 3
    finally:
        daemon.remove_snapshot(tag)


@pytest.mark.timeout(1800)  # 4 BRANCHes and 20 children of a busy guest, under TCG
def test_busy_guest_twenty_of_twenty_children_restore_intact(daemon: Controller, source: str) -> None:
    """20 children of 4 BRANCHes (every mode) of a guest rewriting its buffer in a loop: each one's
    buffer matches its counter, and the process goes on in the children and the source."""
    assert daemon.exec(source, "cat > /tmp/busy.py", stdin=BUSY)["exit_code"] == 0
    sh(daemon, source, START_BUSY)
    steps, bad = busy_check(daemon, source)
    assert bad == -1 or bad == 0
    intact, tags = [], []
    try:
        for n, mode in enumerate(("diff", "full", "live", "diff")):
            tag = f"busy-{n}-{mode}"
            tags.append(tag)
            info = daemon.branch(source, tag, mode=mode)
            print(f"{tag}: pause {info['pause_ms']} ms, {info['private_pages']} private pages, "
                  f"{info['changed_pages']} changed, timings {info['timings']}")
            before, bad = busy_check(daemon, source)
            assert bad == 0 and before > steps  # the source goes on, unharmed
            result = daemon.fork(tag, 5)
            assert result["errors"] == [], result["errors"]
            for child in result["sandboxes"]:
                try:  # the check is done by the busy process itself: it is running
                    child_steps, bad = busy_check(daemon, child["id"])
                    intact.append(bad == 0 and child_steps >= steps)
                finally:
                    daemon.kill(child["id"])
            steps = before
    finally:
        for tag in reversed(tags):
            with contextlib.suppress(ForkdError):
                daemon.remove_snapshot(tag, cascade=True)
    assert intact == [True] * 20
    assert busy_check(daemon, source)[1] == 0


def test_three_layer_chain_info_tamper_and_removal(daemon: Controller, snapshot_tag: str, source: str,
                                                   forkd_home: Path) -> None:
    tags = ["chain-1", "chain-2", "chain-3"]
    sh(daemon, source, "echo 1 > /tmp/layer-1")
    daemon.branch(source, tags[0])
    with child_of(daemon, tags[0]) as one:
        sh(daemon, one, "echo 2 > /tmp/layer-2; echo 2 > /root/layer-2; sync")
        daemon.branch(one, tags[1])
        with child_of(daemon, tags[1]) as two:
            sh(daemon, two, "echo 3 > /tmp/layer-3; rm /tmp/layer-1")
            daemon.branch(two, tags[2])
    try:
        with child_of(daemon, tags[2]) as three:
            assert has(daemon, three, "/tmp/layer-1", "/tmp/layer-2", "/root/layer-2", "/tmp/layer-3") == \
                [False, True, True, True]
        with child_of(daemon, tags[1]) as two_again:
            assert has(daemon, two_again, "/tmp/layer-1", "/tmp/layer-2", "/tmp/layer-3") == [True, True, False]

        top = daemon.snapshot(tags[2])
        assert (top["depth"], top["ancestors"], top["parent_tag"]) == (3, [tags[1], tags[0], snapshot_tag], tags[1])
        assert top["dependents"] == [] and top["memory_kind"] == "diff"
        assert 0 < top["own_bytes"] < top["chain_bytes"]
        listed = {s["tag"]: s for s in daemon.snapshots()}
        assert top["disk"]["logical_bytes"] == listed[tags[2]]["disk"]["logical_bytes"]  # one meaning in both
        base = daemon.snapshot(tags[0])
        assert base["dependents"] == [tags[1]] and set(base["all_dependents"]) == set(tags[1:])
        assert tags[0] in daemon.snapshot(snapshot_tag)["dependents"]

        with pytest.raises(ForkdError) as refused:
            daemon.remove_snapshot(tags[0])
        assert refused.value.status == 409 and "--cascade" in refused.value.message

        layer = forkd_home / "snapshots" / tags[1] / "memory.layer"
        with open(layer, "r+b") as f:  # flip one byte of page data
            f.seek(os.path.getsize(layer) - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ForkdError) as corrupt:
            daemon.fork(tags[2], 1)
        assert corrupt.value.status == 409
        assert tags[1] in corrupt.value.message and "memory.layer" in corrupt.value.message
    finally:
        removed = daemon.remove_snapshot(tags[0], cascade=True)
    assert sorted(removed) == sorted(tags)
    assert all(not (forkd_home / "snapshots" / t).exists() for t in tags)


def _ancestors(daemon: Controller, tag: str) -> list[str]:
    chain, parent = [], daemon.snapshot(tag)["parent_tag"]
    while parent is not None:
        chain.append(parent)
        parent = daemon.snapshot(parent)["parent_tag"]
    return chain


def test_ten_consecutive_branches_and_forced_removal(daemon: Controller, source: str) -> None:
    tags = [f"series-{i}" for i in range(10)]
    sh(daemon, source, TICKER)
    pauses, standalone = [], []
    for i, tag in enumerate(tags):
        sh(daemon, source, f"echo {i} > /tmp/step")
        info = daemon.branch(source, tag)
        assert info["status"] == "ready"
        # A layer on the one before, or written whole where it would pass the suite's max_chain_depth.
        assert info["parent_tag"] in (tags[i - 1] if i else daemon.sandbox(source)["snapshot_tag"], None)
        assert len(_ancestors(daemon, tag)) <= SUITE_MAX_CHAIN_DEPTH
        standalone += [tag] if info["parent_tag"] is None else []
        pauses.append(info["pause_ms"])
    print(f"pause per branch (ms): {pauses}; written whole: {standalone}")
    assert standalone  # ten layers in a row cross the bound
    assert sh(daemon, source, ALIVE) == "ticking\n"
    with child_of(daemon, tags[-1]) as last:
        assert sh(daemon, last, "cat /tmp/step") == "9\n"
        assert sh(daemon, last, ALIVE) == "ticking\n"
    # A layer in the middle of a chain (one below it, one above): forced out, it orphans the one above.
    middle = next(i for i in range(1, 9) if _ancestors(daemon, tags[i + 1])[:2] == [tags[i], tags[i - 1]])
    try:
        assert daemon.remove_snapshot(tags[middle], force=True) == [tags[middle]]
        with pytest.raises(ForkdError) as orphaned:
            daemon.fork(tags[middle + 1], 1)
        assert orphaned.value.status == 409 and tags[middle] in orphaned.value.message
        with child_of(daemon, tags[middle - 1]) as below:  # links under the removed one still work
            assert sh(daemon, below, "cat /tmp/step") == f"{middle - 1}\n"
    finally:
        for tag in reversed(tags):
            with contextlib.suppress(ForkdError):
                daemon.remove_snapshot(tag, cascade=True)
    assert not [s for s in daemon.snapshots() if s["tag"].startswith("series-")]


def test_no_wait_branch_conflicts_and_cap(daemon: Controller, snapshot_tag: str, source: str) -> None:
    # 128 MiB of fresh guest pages: the first layer takes a while to write, so both builds are under way at the cap.
    sh(daemon, source, "echo queued > /tmp/queued; head -c 128M /dev/urandom > /tmp/ballast")
    first = daemon.branch(source, "async-1", wait=False)  # answered right after its pause
    try:
        assert first["status"] == "writing" and first["pause_ms"] > 0
        sh(daemon, source, "echo later > /tmp/queued")  # after the pause: not in async-1
        with pytest.raises(ForkdError) as writing:
            daemon.fork("async-1", 1)
        assert writing.value.status == 409 and "writing" in writing.value.message
        # Every other way to make a snapshot of the tag being written is refused at once, with nothing started.
        for attempt in (lambda: daemon.branch(source, "async-1", wait=False),
                        lambda: daemon.create_snapshot("async-1"),
                        lambda: daemon.compact(snapshot_tag, "async-1"),
                        lambda: daemon.snapshot_diff(snapshot_tag, "async-1", "true")):
            with pytest.raises(ForkdError) as same_tag:
                attempt()
            assert same_tag.value.status == 409 and "async-1" in same_tag.value.message
        # Captured without waiting for the first to be written; its layer is written once the first's is.
        second = daemon.branch(source, "async-2", wait=False)
        assert second["status"] == "writing" and second["parent_tag"] == "async-1"
        # The default cap is 2 branches being written. Sent bare: the SDK would wait out the refusal and retry.
        capped = daemon._http.post(f"/v1/sandboxes/{source}/branch",
                                   json={"tag": "async-3", "mode": "diff", "wait": False})
        assert capped.status_code == 503 and capped.json()["error"]["code"] == "busy", capped.text
        assert "Retry-After" in capped.headers
        assert daemon.wait_snapshot("async-1", timeout_s=300)["status"] == "ready"
        assert daemon.wait_snapshot("async-2", timeout_s=300)["status"] == "ready"
        assert daemon.snapshot("async-2")["parent_tag"] == "async-1"
        with child_of(daemon, "async-1") as child:
            assert sh(daemon, child, "cat /tmp/queued") == "queued\n"
        with child_of(daemon, "async-2") as child:
            assert sh(daemon, child, "cat /tmp/queued") == "later\n"
    finally:
        for tag in ("async-3", "async-2", "async-1"):  # async-3 too, should the cap not have held
            with contextlib.suppress(ForkdError):
                daemon.wait_snapshot(tag, timeout_s=300)
                daemon.remove_snapshot(tag)


def filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` is on, from /proc/mounts (longest mount point that holds it)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, fstype, *_ = line.split()
        if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fstype
    return kind


def test_live_branch_on_a_disk_filesystem(daemon: Controller, source: str, forkd_home: Path) -> None:
    """``live`` no longer depends on userfaultfd write protection, so it works with FORKD_HOME on ext4."""
    print(f"FORKD_HOME {forkd_home} is on {filesystem_of(forkd_home)}")
    sh(daemon, source, f"{TICKER}; echo live > /tmp/live-marker")
    try:
        info = daemon.branch(source, "live-1", mode="live")
        assert info["status"] == "ready" and info["memory_kind"] == "full" and "precopied" in info
        with child_of(daemon, "live-1") as child:
            assert sh(daemon, child, "cat /tmp/live-marker") == "live\n"
            assert sh(daemon, child, ALIVE) == "ticking\n"
    finally:
        with contextlib.suppress(ForkdError):
            daemon.remove_snapshot("live-1")
    assert sh(daemon, source, ALIVE) == "ticking\n"


def test_snapshot_diff_then_compact_to_a_standalone_snapshot(daemon: Controller, snapshot_tag: str) -> None:
    running = {s["id"] for s in daemon.sandboxes()}
    first = daemon.snapshot_diff(snapshot_tag, "diff-1", "echo one > /tmp/d1; echo disk > /root/d1; sync")
    try:
        assert (first["parent_tag"], first["memory_kind"]) == (snapshot_tag, "diff") and first["changed_pages"] > 0
        daemon.snapshot_diff("diff-1", "diff-2", "echo two > /tmp/d2")
        with pytest.raises(ForkdError) as failed:
            daemon.snapshot_diff(snapshot_tag, "diff-bad", "echo nope >&2; exit 3")
        assert "exited with 3" in failed.value.message and "nope" in failed.value.message
        assert "diff-bad" not in {s["tag"] for s in daemon.snapshots()}
        assert {s["id"] for s in daemon.sandboxes()} == running, "snapshot-diff must kill its child"

        flat = daemon.compact("diff-2", "diff-flat")
        assert flat["parent_tag"] is None and flat["compacted_chain"] == ["diff-2", "diff-1", snapshot_tag]
    finally:
        daemon.remove_snapshot("diff-1", cascade=True)
    try:
        assert daemon.snapshot("diff-flat")["depth"] == 0
        with child_of(daemon, "diff-flat") as child:  # its chain is gone: it needs none of it
            assert sh(daemon, child, "cat /tmp/d1 /root/d1 /tmp/d2 /tmp/warm-marker") == "one\ndisk\ntwo\nwarmed\n"
    finally:
        daemon.remove_snapshot("diff-flat")


def test_cli_branch_info_compact_and_rmi(daemon: Controller, source: str, vm_env: dict[str, str]) -> None:
    def forkd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "forkd", *args], env=vm_env, capture_output=True, text=True,
                              timeout=300)

    sh(daemon, source, "echo cli > /tmp/cli-marker")
    started = forkd("branch", source, "--tag", "cli-1", "--no-wait", "--json")
    assert started.returncode == 0, started.stderr
    assert json.loads(started.stdout)["status"] == "writing"
    daemon.wait_snapshot("cli-1", timeout_s=300)
    info = forkd("snapshot-info", "cli-1")
    assert info.returncode == 0 and "ready, depth 1" in info.stdout and "ancestors:" in info.stdout, info.stdout
    compacted = forkd("snapshot-compact", "--from", "cli-1", "--to", "cli-flat")
    assert compacted.returncode == 0 and "standalone copy of cli-1" in compacted.stdout, compacted.stderr
    verbose = forkd("branch", source, "--tag", "cli-2", "-v")
    assert verbose.returncode == 0, verbose.stderr
    assert all(stage in verbose.stdout for stage in ("stop", "disk_switched", "device_state_saved", "pages_read",
                                                     "cont", "layer_written", "published")), verbose.stdout
    assert forkd("rmi", "cli-2").returncode == 0
    refused = forkd("branch", source, "--tag", "cli-1")
    assert refused.returncode == 1 and "exists" in refused.stderr
    with child_of(daemon, "cli-flat") as child:
        assert sh(daemon, child, "cat /tmp/cli-marker") == "cli\n"
    removed = forkd("rmi", "cli-flat")
    assert removed.returncode == 0 and "removed snapshot cli-flat" in removed.stdout
    removed = forkd("rmi", "cli-1")
    assert removed.returncode == 0, removed.stderr
