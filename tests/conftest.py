"""Fixtures shared by the VM tests: one daemon, one image (cached across runs) and one warm snapshot.

The daemon is the real one, started as its own process with a private FORKD_HOME and socket; the
guest image comes from the shared FORKD_CACHE so it is built once per machine, keyed by its inputs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller, DaemonUnreachable, ForkdError

VM_SNAPSHOT = "vmtest"
# Leaves a file in the guest's RAM-backed /tmp and a process running, then reports ready.
WARMUP_CMD = "echo warmed > /tmp/warm-marker; echo '{\"ready\": true}'; exec sleep 86400"


def vm_env_for(home: Path) -> dict[str, str]:
    env = os.environ.copy()
    env["FORKD_HOME"] = str(home)
    env["FORKD_SOCKET"] = str(home / "forkd.sock")
    env.pop("FORKD_URL", None)
    # nat guests' DNS relay goes to the "outside" namespace tests/vm/test_network.py makes, never off the host.
    env["FORKD_DNS"] = "192.168.250.2"
    env["FORKD_E2B_LISTEN"] = f"127.0.0.1:{free_port()}"  # the E2B front (tests/vm/test_e2b.py)
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def forkd_home() -> Iterator[Path]:
    home = Path(tempfile.mkdtemp(prefix="forkd-test-", dir="/var/tmp"))
    yield home
    if os.environ.get("FORKD_KEEP_TEST_HOME"):
        print(f"kept test FORKD_HOME {home}", file=sys.stderr)
    else:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def vm_env(forkd_home: Path) -> dict[str, str]:
    return vm_env_for(forkd_home)


def start_daemon(home: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Controller]:
    """A real daemon process on ``home``, answering on its socket (fails the test if it does not start)."""
    with open(home / "daemon.log", "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "forkd", "daemon"], env=env, stdout=log, stderr=log)
    controller = Controller(url=f"unix://{env['FORKD_SOCKET']}")
    deadline = time.monotonic() + 30
    while True:
        try:
            controller.health()
            return process, controller
        except DaemonUnreachable:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"daemon did not start: {(home / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.1)


def stop_daemon(process: subprocess.Popen[bytes], controller: Controller, home: Path) -> None:
    """SIGTERM the daemon and check it took every VMM it started down with it."""
    controller.close()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
    leaked = vmm_processes_under(home)
    for pid in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not leaked, f"the stopped daemon left VMM processes running: {leaked}"


@pytest.fixture(scope="session")
def daemon(forkd_home: Path, vm_env: dict[str, str]) -> Iterator[Controller]:
    """A real daemon process for the whole session; stopped (and its VMs with it) at the end."""
    if os.geteuid() != 0:
        pytest.skip("VM tests need root")
    process, controller = start_daemon(forkd_home, vm_env)
    yield controller
    stop_daemon(process, controller, forkd_home)


def vmm_processes_under(directory: Path) -> list[int]:
    """Pids of live processes whose command line mentions ``directory`` (our VMMs do)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(directory).encode() in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


def _progress(line: str) -> None:
    print(f"[forkd] {line}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def snapshot_tag(daemon: Controller) -> str:
    """The default image (built or reused) and one warm snapshot shared by every VM test."""
    daemon.build_image(on_progress=_progress, name="default")
    daemon.create_snapshot(VM_SNAPSHOT, on_progress=_progress, memory_mib=1024, warm_modules=["numpy"],
                           warmup_cmd=WARMUP_CMD)
    return VM_SNAPSHOT


@pytest.fixture
def children(daemon: Controller, snapshot_tag: str) -> Iterator[list[str]]:
    """Three children of the shared snapshot, killed after the test."""
    result = daemon.fork(snapshot_tag, 3)
    assert result["errors"] == []
    ids = [child["id"] for child in result["sandboxes"]]
    yield ids
    for sandbox_id in ids:
        with contextlib.suppress(ForkdError):  # already gone: the test killed it
            daemon.kill(sandbox_id)
