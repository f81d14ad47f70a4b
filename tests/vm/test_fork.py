"""Forking real QEMU guests from one warm snapshot, through the real daemon and agent."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.vm


def _value(result: dict) -> object:
    assert result.get("error") is None, result
    return result["value_json"]


def test_children_answer_eval_and_exec(daemon: Controller, children: list[str]) -> None:
    for sandbox_id in children:
        assert _value(daemon.eval(sandbox_id, "int(numpy.arange(10).sum())")) == 45
        result = daemon.exec(sandbox_id, ["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (result["stdout"], result["stderr"], result["exit_code"]) == ("out\n", "err\n", 3)


def test_a_client_that_asks_gets_every_hop_of_its_call(vm_env: dict[str, str], children: list[str]) -> None:
    """Server-Timing of an eval through the real daemon, agent and context process: the daemon's stages, the
    guest's (its marks in time order, from the agent and the context), and the transport between."""
    transport = httpx.HTTPTransport(uds=vm_env["FORKD_SOCKET"])
    with httpx.Client(transport=transport, base_url="http://forkd", timeout=60) as client:
        url = f"/v1/sandboxes/{children[0]}/eval"
        plain = client.post(url, json={"expr": "1+1"})
        traced = client.post(url, json={"expr": "1+1"}, headers={"X-Forkd-Timings": "1"})
        ping = client.post(f"/v1/sandboxes/{children[0]}/ping", headers={"X-Forkd-Timings": "1"})
    assert plain.json()["value_json"] == traced.json()["value_json"] == 2
    assert "server-timing" not in plain.headers
    stages = {name: float(ms) for name, ms in
              (part.strip().split(";dur=") for part in traced.headers["server-timing"].split(","))}
    assert [s for s in stages if not s.startswith("guest") and s != "transport"] == [
        "routed", "awake", "agent_sent", "agent_answer", "agent_resumed", "answer_ready", "total"]
    assert {"guest.decoded", "guest.started", "guest.ctx_read", "guest.ctx_ran", "guest.ctx_answered",
            "guest.handled"} <= stages.keys()
    assert abs(sum(v for k, v in stages.items() if k.startswith("guest.")) - stages["guest"]) < 0.05
    # The guest's stages are on its own clock, whose rate a TCG guest calibrated at its parent's boot (it may
    # differ from the host's: bench/roundtrip.py measures it); transport is the host's wait beyond them.
    assert stages["guest"] > 0 and abs(stages["guest"] + stages["transport"] - stages["agent_answer"]) < 0.05
    ping_stages = ping.headers["server-timing"]
    assert "guest.handled" in ping_stages and "guest.ctx_ran" not in ping_stages


def test_streamed_exec_delivers_output_before_exit(daemon: Controller, children: list[str]) -> None:
    arrivals: list[tuple[float, dict]] = []
    result = daemon.exec(children[0], "echo first; sleep 4; echo second", timeout_s=30,
                         on_event=lambda event: arrivals.append((time.monotonic(), event)))
    done = time.monotonic()
    stdout = [(t, e["data"]) for t, e in arrivals if e.get("event") == "stdout"]
    assert "".join(d for _, d in stdout) == "first\nsecond\n"
    assert done - stdout[0][0] > 2.0, "the first line must arrive while the command still runs"
    assert result["exit_code"] == 0


def test_writes_are_private_to_each_child(daemon: Controller, snapshot_tag: str, children: list[str]) -> None:
    writer, other, _ = children
    daemon.write_file(writer, "/root/private.txt", b"only in the writer")
    daemon.exec(writer, "echo scratch > /tmp/scratch && sync")
    assert daemon.read_file(writer, "/root/private.txt") == b"only in the writer"
    assert daemon.exec(other, "ls /root/private.txt /tmp/scratch 2>/dev/null | wc -l")["stdout"] == "0\n"
    fresh = daemon.fork(snapshot_tag, 1)["sandboxes"][0]["id"]  # the parent's disk and memory are untouched
    try:
        assert daemon.exec(fresh, "ls /root/private.txt /tmp/scratch 2>/dev/null | wc -l")["stdout"] == "0\n"
    finally:
        daemon.kill(fresh)


def test_children_are_distinct(daemon: Controller, children: list[str]) -> None:
    probe = ("(os.urandom(16).hex(), random.random(), float(numpy.random.rand()), socket.gethostname(), "
             "time.time())")
    daemon_time = time.time()
    seen = []
    for sandbox_id in children:
        daemon.run_code(sandbox_id, "import os, random, socket, time")
        urandom, py_random, np_random, hostname, clock = _value(daemon.eval(sandbox_id, probe))
        assert hostname == sandbox_id
        assert abs(clock - daemon_time) < 30, "the guest clock is set to host time after restore"
        seen.append((urandom, py_random, np_random))
    for column in zip(*seen):
        assert len(set(column)) == len(children), f"identical values across children: {column}"


def test_a_childs_first_cell_already_draws_from_its_own_seed(daemon: Controller, snapshot_tag: str) -> None:
    """The snapshot's default context is reseeded with a child's first cell, not when the child answers:
    that very cell must not see the generators the restore copied, which every sibling would share."""
    siblings = [child["id"] for child in daemon.fork(snapshot_tag, 3)["sandboxes"]]
    try:
        first = [tuple(_value(daemon.eval(sandbox_id, "[__import__('random').random(), float(numpy.random.rand())]")))
                 for sandbox_id in siblings]  # numpy: imported by the warm-up, its state saved
    finally:
        for sandbox_id in siblings:
            daemon.kill(sandbox_id)
    for column in zip(*first):
        assert len(set(column)) == len(siblings), f"siblings' first cells drew the same values: {column}"


def test_run_code_keeps_state_and_reports_errors(daemon: Controller, children: list[str]) -> None:
    sandbox_id = children[0]
    first = daemon.run_code(sandbox_id, "x = 20\nprint('set')\nx + 1")
    assert (first["stdout"], first["value"], first["error"]) == ("set\n", "21", None)
    assert daemon.run_code(sandbox_id, "x * 2")["value"] == "40"
    failed = daemon.run_code(sandbox_id, "1 / 0")
    assert failed["error"]["name"] == "ZeroDivisionError"
    assert "Traceback" in failed["error"]["traceback"]


def test_bad_requests_get_errors_and_the_agent_survives(daemon: Controller, children: list[str]) -> None:
    sandbox_id = children[0]
    with pytest.raises(ForkdError) as missing:
        daemon.exec(sandbox_id, ["/no/such/binary"])
    assert missing.value.status in (400, 404)
    with pytest.raises(ForkdError) as no_file:
        daemon.read_file(sandbox_id, "/no/such/file")
    assert no_file.value.status == 404
    assert daemon.eval(sandbox_id, "1 +")["error"]["name"] == "SyntaxError"
    assert _value(daemon.eval(sandbox_id, "2 + 2")) == 4


def test_files_round_trip_binary_data(daemon: Controller, children: list[str]) -> None:
    sandbox_id = children[0]
    payload = os.urandom(9 * 1024 * 1024 + 17)  # more than two agent chunks
    daemon.write_file(sandbox_id, "/root/blob.bin", payload)
    assert daemon.read_file(sandbox_id, "/root/blob.bin") == payload
    assert daemon.stat(sandbox_id, "/root/blob.bin")["size"] == len(payload)
    assert "blob.bin" in [e["name"] for e in daemon.list_files(sandbox_id, "/root")]
    daemon.remove_file(sandbox_id, "/root/blob.bin")
    assert "blob.bin" not in [e["name"] for e in daemon.list_files(sandbox_id, "/root")]


def test_kill_releases_everything(daemon: Controller, snapshot_tag: str, forkd_home: Path) -> None:
    child = daemon.fork(snapshot_tag, 1)["sandboxes"][0]
    run_dir = forkd_home / "sandboxes" / child["id"]
    assert run_dir.is_dir() and Path(f"/proc/{child['pid']}").exists()
    daemon.kill(child["id"])
    assert not run_dir.exists()
    assert not Path(f"/proc/{child['pid']}").exists()
    assert child["id"] not in [s["id"] for s in daemon.sandboxes()]


def test_vmms_run_without_transparent_huge_pages(daemon: Controller, children: list[str]) -> None:
    """A huge page QEMU advises is private as a whole once written: the daemon's VMMs start with THP off."""
    for sandbox_id in children:
        status = Path(f"/proc/{daemon.sandbox(sandbox_id)['pid']}/status").read_text()
        assert "THP_enabled:\t0" in status
        assert _value(daemon.eval(sandbox_id, "float(numpy.ones(4).sum())")) == 4.0


def test_vmm_killed_from_outside_is_released(daemon: Controller, snapshot_tag: str, forkd_home: Path) -> None:
    child = daemon.fork(snapshot_tag, 1)["sandboxes"][0]
    os.kill(child["pid"], 9)
    deadline = time.monotonic() + 60  # released at once on a quiet machine; bounded for a loaded one
    while child["id"] in [s["id"] for s in daemon.sandboxes()] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child["id"] not in [s["id"] for s in daemon.sandboxes()]
    assert not (forkd_home / "sandboxes" / child["id"]).exists()


def test_bad_tags_are_refused_before_the_filesystem(daemon: Controller, forkd_home: Path) -> None:
    for tag in ("../etc", "a/b", "", "x" * 65, "spaces here"):
        with pytest.raises(ForkdError) as refused:
            daemon.fork(tag, 1)
        assert refused.value.status in (400, 404), tag
    with pytest.raises(ForkdError) as refused:
        daemon.create_snapshot("../../escape")
    assert refused.value.status == 400
    assert not (forkd_home.parent / "escape").exists()
    with pytest.raises(ForkdError) as too_many:
        daemon.fork("vmtest", 100000)
    assert too_many.value.status == 400


def test_cli_fork_exec_ls_kill(vm_env: dict[str, str], snapshot_tag: str) -> None:
    def forkd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "forkd", *args], env=vm_env, capture_output=True, text=True,
                              timeout=300)

    forked = forkd("fork", "--tag", snapshot_tag, "-n", "2", "--json", "--env", "STAGE=ci", "--label", "team=qa",
                   "--timeout", "3600")
    assert forked.returncode == 0, forked.stderr
    children = json.loads(forked.stdout)["sandboxes"]
    ids = [child["id"] for child in children]
    assert len(ids) == 2
    assert all(child["metadata"] == {"team": "qa"} and child["end_at"] for child in children)
    assert "envs" not in children[0]  # envs may hold secrets: used, never returned
    ran = forkd("exec", ids[0], "--", "python3", "-c", "import os; print(6*7, os.environ['STAGE'])")
    assert (ran.returncode, ran.stdout) == (0, "42 ci\n")
    assert forkd("fork", "--tag", snapshot_tag, "--env", "NOEQUALS").returncode == 2
    stages = [stage for stage in children[0]["timings"] if stage != "total"]  # in the order they ran
    assert stages[-3:] == ["cont", "reseed", "recorded"] and "state_loaded" in stages, children[0]["timings"]
    verbose = forkd("fork", "--tag", snapshot_tag, "-v")
    assert verbose.returncode == 0 and "qmp_greeting" in verbose.stdout and "reseed" in verbose.stdout, verbose.stdout
    assert forkd("kill", verbose.stdout.split()[0]).returncode == 0
    assert forkd("exec", ids[0], "--", "false").returncode == 1
    evaluated = forkd("eval", ids[1], "numpy.__name__")
    assert evaluated.stdout.strip() == "'numpy'"
    assert all(sandbox_id in forkd("ls").stdout for sandbox_id in ids)
    assert forkd("kill", *ids).returncode == 0
    assert not any(sandbox_id in forkd("ls").stdout for sandbox_id in ids)
    refused = forkd("fork", "--tag", "../etc", "-n", "1")
    assert refused.returncode != 0 and "tag" in refused.stderr


def test_tampered_snapshot_is_refused(daemon: Controller, forkd_home: Path) -> None:
    daemon.create_snapshot("tamper", on_progress=None, memory_mib=256, warm_modules=[])
    state = forkd_home / "snapshots" / "tamper" / "state"
    with open(state, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ForkdError) as refused:
        daemon.fork("tamper", 1)
    assert refused.value.status == 409 and "state" in refused.value.message
    daemon.remove_snapshot("tamper")


def test_mismatched_snapshot_is_refused(daemon: Controller, snapshot_tag: str, forkd_home: Path) -> None:
    db = sqlite3.connect(forkd_home / "state.db")
    try:
        (meta_text,) = db.execute("SELECT meta FROM snapshots WHERE tag = ?", (snapshot_tag,)).fetchone()
        meta = json.loads(meta_text)
        meta["identity"]["vmm_version"] = "6.0.0"
        db.execute("INSERT INTO snapshots (tag, status, image, path, created_at, meta) "
                   "SELECT 'mismatch', status, image, path, created_at, ? FROM snapshots WHERE tag = ?",
                   (json.dumps(meta), snapshot_tag))
        db.commit()
        with pytest.raises(ForkdError) as refused:
            daemon.fork("mismatch", 1)
        assert refused.value.status == 409
        assert "vmm_version" in refused.value.message and "6.0.0" in refused.value.message
    finally:
        db.execute("DELETE FROM snapshots WHERE tag = 'mismatch'")
        db.commit()
        db.close()


def test_warmup_state_is_inherited(daemon: Controller, children: list[str]) -> None:
    for sandbox_id in children:
        assert daemon.exec(sandbox_id, "cat /tmp/warm-marker")["stdout"] == "warmed\n"
        processes = daemon.exec(sandbox_id, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")["stdout"]
        assert "sleep 86400" in processes, "the warmup command keeps running in every child"


def test_quickstart_runs_and_then_reuses_everything(vm_env: dict[str, str], snapshot_tag: str) -> None:
    def quickstart() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "forkd", "quickstart", "--yes", "-n", "3"], env=vm_env,
                              capture_output=True, text=True, timeout=900)

    first = quickstart()
    assert first.returncode == 0, first.stdout + first.stderr
    assert "3/3 children answering" in first.stdout
    second = quickstart()
    assert second.returncode == 0, second.stdout + second.stderr
    assert "3/3 children answering" in second.stdout
    assert "booting parent" not in second.stdout and "is up to date" in second.stdout
