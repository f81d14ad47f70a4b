"""Guest output cannot exhaust the daemon's memory (issue: hostile guests flooding stdout).

A real guest floods (``/dev/urandom``, ``yes``) through a non-streamed exec and through a stream
whose client stops reading. The daemon's peak RSS (``VmHWM`` in /proc, reset before each flood)
stays under ``RSS_GROWTH_BOUND_MIB`` above its level before, while a sibling sandbox keeps answering.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.vm

# Budgets behind it: a non-streamed result keeps 4 MiB (config output.result_bytes), a stream queues
# at most 4 x 1 MiB before the agent's connection is held, one agent frame is at most 16 MiB.
RSS_GROWTH_BOUND_MIB = 160


def _daemon_pid(home: Path) -> int:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"daemon" in (proc / "cmdline").read_bytes() and \
                    f"FORKD_HOME={home}".encode() in (proc / "environ").read_bytes():
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no daemon process for {home}")


def _status_kib(pid: int, field: str) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def _reset_peak(pid: int) -> int:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := current RSS
    return _status_kib(pid, "VmRSS")


class Sibling(threading.Thread):
    """Keeps asking the other sandbox something while the flood runs; records every answer."""

    def __init__(self, daemon: Controller, sandbox_id: str) -> None:
        super().__init__(daemon=True)
        self.controller = Controller(url=daemon.url)
        self.sandbox_id = sandbox_id
        self.stop = threading.Event()
        self.answers: list[str] = []

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                result = self.controller.exec(self.sandbox_id, f"echo sibling-{n}", timeout_s=60)
            except ForkdError as exc:
                self.answers.append(f"error: {exc}")
                return
            self.answers.append(result["stdout"].strip())

    def finish(self) -> list[str]:
        self.stop.set()
        self.join(timeout=120)
        self.controller.close()
        return self.answers


@pytest.fixture
def pair(daemon: Controller, snapshot_tag: str):  # type: ignore[no-untyped-def]
    result = daemon.fork(snapshot_tag, 2)
    assert result["errors"] == []
    ids = [child["id"] for child in result["sandboxes"]]
    yield ids
    for sandbox_id in ids:
        daemon.kill(sandbox_id)


def test_a_flood_through_exec_is_truncated_and_memory_stays_bounded(daemon: Controller, pair: list[str],
                                                                    forkd_home: Path) -> None:
    flooder, sibling_id = pair
    pid = _daemon_pid(forkd_home)
    before_kib = _reset_peak(pid)
    sibling = Sibling(daemon, sibling_id)
    sibling.start()
    try:
        # Six times the result budget, however fast the guest makes it.
        result = daemon.exec(flooder, "head -c 24M /dev/urandom", timeout_s=600)
    finally:
        answers = sibling.finish()
    growth_mib = (_status_kib(pid, "VmHWM") - before_kib) / 1024
    assert result["truncated"] is True and result["exit_code"] == 0
    assert 0 < len(result["stdout"].encode()) <= 3 * (4 << 20)  # 4 MiB of bytes, each at most one U+FFFD
    assert answers and answers == [f"sibling-{n}" for n in range(1, len(answers) + 1)]
    assert growth_mib < RSS_GROWTH_BOUND_MIB, f"daemon RSS grew {growth_mib:.0f} MiB during the flood"
    print(f"daemon peak RSS growth {growth_mib:.1f} MiB; sibling answered {len(answers)} times")


def test_a_stream_nobody_reads_holds_the_guest_and_a_disconnect_ends_it(daemon: Controller, pair: list[str],
                                                                        vm_env: dict[str, str]) -> None:
    flooder, sibling_id = pair
    sibling = Sibling(daemon, sibling_id)
    sibling.start()
    try:
        growth_mib, started = _stall_a_stream(flooder, vm_env)
    finally:
        answers = sibling.finish()
    # The client has gone: the command is ended in the guest (no `yes` left running).
    deadline = time.monotonic() + 60
    while any(p["pid"] == started["pid"] and p["running"] for p in daemon.processes(flooder)):
        assert time.monotonic() < deadline, "the streamed command outlived its client"
        time.sleep(0.5)
    assert answers and answers == [f"sibling-{n}" for n in range(1, len(answers) + 1)]
    assert daemon.exec(flooder, "echo still-here")["stdout"].strip() == "still-here"
    assert growth_mib < RSS_GROWTH_BOUND_MIB, f"daemon RSS grew {growth_mib:.0f} MiB while the stream stalled"
    print(f"daemon peak RSS growth {growth_mib:.1f} MiB; sibling answered {len(answers)} times")


def _stall_a_stream(flooder: str, vm_env: dict[str, str]) -> tuple[float, dict[str, object]]:
    """Start ``yes`` streamed, read two lines, stop reading for 20 s, then disconnect."""
    pid = _daemon_pid(Path(vm_env["FORKD_HOME"]))
    before_kib = _reset_peak(pid)
    transport = httpx.HTTPTransport(uds=vm_env["FORKD_SOCKET"])
    with httpx.Client(transport=transport, base_url="http://forkd", timeout=60) as client:
        with client.stream("POST", f"/v1/sandboxes/{flooder}/exec",
                           json={"cmd": "yes flood", "stream": True, "timeout_s": 600}) as answer:
            lines = answer.iter_lines()
            started = json.loads(next(lines))
            assert started["event"] == "started"
            assert json.loads(next(lines))["event"] == "stdout"
            time.sleep(20)  # the client stops reading while the guest floods
            return (_status_kib(pid, "VmHWM") - before_kib) / 1024, started
