"""The rest of E2B's API with E2B's unmodified Python SDKs: snapshots, lifecycle (pause at the
timeout, resume on the next request, 10 cycles keeping every kind of state), metrics, routes this
server does not serve (501, not "not found"), and the collection of fork snapshots.

Pointed at forkd only through E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and E2B_TEST_TEMPLATE (a
snapshot with the code interpreter). Prints ``ok NAME`` / ``FAIL NAME: why`` per check and exits
non-zero if any failed; names given as arguments run only those.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import httpx
from e2b import NotFoundException, Sandbox, SandboxException, SandboxState
from e2b_code_interpreter import Sandbox as CodeSandbox

from checks import check, failures

TEMPLATE = os.environ["E2B_TEST_TEMPLATE"]
API = {"base_url": os.environ["E2B_API_URL"], "headers": {"X-API-KEY": os.environ["E2B_API_KEY"]}, "timeout": 300}
CYCLES = 10


def wait_for(what: str, test: Callable[[], bool], within_s: float) -> None:
    """Poll ``test`` until it holds (a bound, not a measurement: the keeper's rounds run on their own)."""
    end = time.monotonic() + within_s
    while not test():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {within_s:.0f} s")
        time.sleep(1)


def unsupported() -> None:
    with httpx.Client(**API) as client:  # type: ignore[arg-type]
        for method, path in [("GET", "/volumes"), ("GET", "/v2/sandboxes/sb-aaaaaaaaaaaa/logs"), ("POST", "/v3/templates")]:
            answer = client.request(method, path, json={})
            assert answer.status_code == 501 and "not supported by this server" in answer.json()["message"], answer.text
    sbx = Sandbox.create(template=TEMPLATE, timeout=300)
    try:  # the SDK's own call of an unserved route: an error that says so, not "sandbox not found"
        try:
            sbx.create_snapshot(mode="filesystem")
        except NotFoundException as exc:
            raise AssertionError(f"read as not found: {exc}") from exc
        except SandboxException as exc:
            assert "filesystem" in str(exc), exc
        else:
            raise AssertionError("a filesystem-only snapshot was taken")
    finally:
        sbx.kill()


def snapshots() -> None:
    sbx = Sandbox.create(template=TEMPLATE, timeout=600)
    made: Sandbox | None = None
    try:
        sbx.files.write("/tmp/snap-state", "in memory")
        sbx.commands.run("echo on-disk > /root/snap-disk && sync")
        bg = sbx.commands.run("sleep 3600", background=True)
        snap = sbx.create_snapshot()
        listed = [s.snapshot_id for s in sbx.list_snapshots().next_items()]
        assert snap.snapshot_id in listed, listed
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        sbx.files.write("/tmp/snap-state", "changed after the snapshot")
        made = Sandbox.create(snap.snapshot_id, timeout=300)
        assert made.files.read("/tmp/snap-state") == "in memory"
        assert made.files.read("/root/snap-disk") == "on-disk\n"
        assert bg.pid in [p.pid for p in made.commands.list()]  # its processes, as they ran
        assert sbx.files.read("/tmp/snap-state") == "changed after the snapshot"  # the source kept running
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert made.commands.run("cat /root/snap-disk").stdout == "on-disk\n"  # a deleted snapshot's child runs on
    finally:
        for box in (made, sbx):
            if box is not None:
                box.kill()


STATE_CELL = """
import socket, subprocess
counter = 0
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
client = socket.create_connection(listener.getsockname()); server, _ = listener.accept()
sleeper = subprocess.Popen(["sleep", "86400"])
sleeper.pid
"""
CYCLE_CELL = """
counter += 1
client.sendall(b"ping %d" % counter)
(counter, server.recv(64).decode(), sleeper.poll())
"""


def lifecycle() -> None:
    """Paused at its timeout by the daemon, then 9 more pauses; each resumed by the next request
    alone (no connect), keeping its id, files in /tmp and on disk, processes, interpreter
    variables and an open TCP connection inside the guest."""
    code = CodeSandbox.create(template=TEMPLATE, timeout=600, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sandbox_id = code.sandbox_id
        assert code.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}, code.get_info().lifecycle
        first = code.run_code(STATE_CELL)
        assert first.error is None, first.error
        pid = int(first.text)
        code.files.write("/tmp/cycle", "kept")
        code.commands.run("echo disk-kept > /root/cycle && sync")
        code.set_timeout(5)  # the daemon pauses it 5 s from now
        wait_for("paused at its timeout",
                 lambda: Sandbox.get_info(sandbox_id).state == SandboxState.PAUSED, 180)
        for cycle in range(1, CYCLES + 1):
            if cycle > 1:
                assert code.pause() is True
                assert Sandbox.get_info(sandbox_id).state == SandboxState.PAUSED
            ran = code.run_code(CYCLE_CELL, timeout=300)  # this request alone resumes it
            assert ran.error is None, (cycle, ran.error)
            assert ran.text == repr((cycle, f"ping {cycle}", None)), (cycle, ran.text)
            info = Sandbox.get_info(sandbox_id)
            assert info.sandbox_id == sandbox_id and info.state == SandboxState.RUNNING, info
            assert code.files.read("/tmp/cycle") == "kept"
            assert code.files.read("/root/cycle") == "disk-kept\n"
            assert code.commands.run(f"kill -0 {pid} && echo alive").stdout == "alive\n"
            print(f"cycle {cycle} ok", flush=True)
    finally:
        code.kill()


def metrics() -> None:
    sbx = Sandbox.create(template=TEMPLATE, timeout=600)
    try:
        sbx.commands.run("python3 -c 'sum(range(3 * 10**6))'", timeout=300)
        first = sbx.get_metrics()
        assert first, "no sample"
        sample = first[-1]
        assert sample.cpu_count >= 1 and 0 <= sample.cpu_used_pct <= 100, sample
        assert 0 < sample.mem_used < sample.mem_total and 0 < sample.disk_used < sample.disk_total, sample
        wait_for("a second sample", lambda: len(sbx.get_metrics()) >= 2, 120)
        times = [m.timestamp for m in sbx.get_metrics()]
        assert times == sorted(times) and len(set(times)) == len(times), times
    finally:
        sbx.kill()


def collected() -> None:
    """A fork's snapshot is removed once its children and its source are gone."""
    sbx = Sandbox.create(template=TEMPLATE, timeout=600)
    (child,) = sbx.fork(count=1, timeout=300)
    tag = child.get_info().template_id
    with httpx.Client(**API) as client:  # type: ignore[arg-type]
        def templates() -> set[str]:
            return {t["templateID"] for t in client.get("/templates").json()}
        assert tag in templates()
        child.kill()
        sbx.kill()
        wait_for(f"{tag} collected", lambda: tag not in templates(), 240)


def main() -> int:
    for name, body in [("unsupported", unsupported), ("snapshots", snapshots), ("lifecycle", lifecycle),
                       ("metrics", metrics), ("collected", collected)]:
        if len(sys.argv) == 1 or name in sys.argv[1:]:
            check(name, body)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
