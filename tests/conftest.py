"""Fixtures shared by the VM tests: one daemon, one image (cached across runs) and one warm snapshot.

The daemon is the real one, started as its own process with a private FORKD_HOME and socket; the
guest image comes from the shared FORKD_CACHE so it is built once per machine, keyed by its inputs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.config import paths_from_env
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
    return env


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


WORKLOADS_IMAGE = "workloads"
WORKLOADS_SNAPSHOT = "workloads"
#: Debian packages of the real-workload image: the scientific stack, a chart library and a database.
WORKLOADS_PACKAGES = ["python3-pandas", "python3-sklearn", "python3-matplotlib", "postgresql"]


@pytest.fixture(scope="session")
def workloads_ca(vm_env: dict[str, str]) -> tuple[Path, Path, Path]:
    """A CA and a ``localhost`` server certificate it signed: (ca.pem, server.pem, server.key).

    Made once per cache directory, so the image that trusts the CA keeps its key between runs.
    """
    cache = paths_from_env(vm_env).cache
    cache.mkdir(parents=True, exist_ok=True)
    directory = cache / "test-ca"
    ca, cert, key = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    if cert.is_file():
        return ca, cert, key
    work = Path(tempfile.mkdtemp(prefix=".test-ca-", dir=cache))

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=work, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=forkd test CA",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key", "-out",
        "server.csr")
    (work / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days",
        "3650", "-extfile", "san.ext", "-out", "server.pem")
    try:
        os.replace(work, directory)
    except OSError:  # another test run made it first: use theirs
        shutil.rmtree(work)
    return ca, cert, key


@pytest.fixture(scope="session")
def workloads_snapshot(daemon: Controller, workloads_ca: tuple[Path, Path, Path]) -> str:
    """A snapshot of the real-workload image with numpy, pandas and sklearn imported and PostgreSQL running,
    seeded by the postgres recipe's warmup (built once per cache, like the default image)."""
    recipe = Path(__file__).resolve().parents[1] / "examples" / "postgres_fixture.py"
    warmup = subprocess.run([sys.executable, str(recipe), "--print-warmup"], check=True, capture_output=True,
                            text=True, timeout=60).stdout.strip()  # the recipe's own warmup, as users run it
    ca, _, _ = workloads_ca
    daemon.build_image(on_progress=_progress, name=WORKLOADS_IMAGE, packages=WORKLOADS_PACKAGES,
                       ca_certs=[ca.read_text()])
    daemon.create_snapshot(WORKLOADS_SNAPSHOT, on_progress=_progress, image=WORKLOADS_IMAGE, memory_mib=1024,
                           warm_modules=["numpy", "pandas", "sklearn", "scipy.linalg", "pytest"], warmup_cmd=warmup)
    return WORKLOADS_SNAPSHOT
