"""Fixtures shared by the VM tests: one daemon, one image (cached across runs) and one warm snapshot.

The daemon is the real one, started as its own process with a private FORKD_HOME and socket; the
guest image comes from the shared FORKD_CACHE so it is built once per machine, keyed by its inputs.

A run that selects VM tests on a host that cannot run them fails at once, saying what is missing:
a suite that passes by skipping every VM test proves nothing. ``FORKD_TESTS=unit`` is the explicit
way to run without them. The summary says how many VM tests ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import zram_swap
from free_ports import free_port

from forkd.config import Paths, paths_from_env
from forkd.guest.protocol import AGENT_VERSION
from forkd.image.store import INITRD_FILE, KERNEL_FILE, ROOTFS_FILE, write_manifest
from forkd.listeners import bind_tcp
from forkd.runtime.isolation import Isolation
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.sandboxes import SandboxService
from forkd.sdk.controller import Controller, DaemonUnreachable, ForkdError
from forkd.store.registry import Registry
from forkd.vmm.backends import create_vmm

#: The VM suite's daemon bounds chains at this many ancestors, so pause, snapshot and BRANCH loops cross it
#: (tests/vm/test_pause_chain_vm.py, test_chain_bound_vm.py, test_branch.py).
SUITE_MAX_CHAIN_DEPTH = 3

VM_SNAPSHOT = "vmtest"
TESTS_ENV = "FORKD_TESTS"  # "unit": leave the VM tests out on purpose
# Leaves a file in the guest's RAM-backed /tmp and a process running, then reports ready.
WARMUP_CMD = "echo warmed > /tmp/warm-marker; echo '{\"ready\": true}'; exec sleep 86400"


def vm_prerequisites_missing() -> list[str]:
    """What this host lacks to run the VM tests, each with what to do about it."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (run the tests as root: VMs, network namespaces and cgroups need it)")
    if shutil.which("qemu-system-x86_64") is None:
        missing.append("QEMU (`bash scripts/setup` installs qemu-system-x86)")
    if shutil.which("ip") is None:
        missing.append("network namespaces through `ip netns` (install iproute2)")
    if shutil.which("nft") is None:
        missing.append("nftables (`bash scripts/setup` installs the nftables package)")
    return missing


#: the package that provides each host tool a root-only unit test runs
TOOL_PACKAGES = {"nft": "nftables", "ip": "iproute2", "setpriv": "util-linux", "unshare": "util-linux",
                 "mkswap": "util-linux", "swapon": "mount"}


def missing_host_tools(*tools: str) -> list[str]:
    """The tools of ``tools`` not on PATH, each with the package to install."""
    return [f"`{tool}` (install {TOOL_PACKAGES[tool]})" for tool in tools if shutil.which(tool) is None]


def require_root(*tools: str) -> None:
    """Fail (never skip) a test that needs root and host tools on a host without them: a root-only test
    that skips proves nothing, and CI runs the suite as root."""
    missing = ([] if os.geteuid() == 0 else ["root (run the suite as root, as CI does: bash .ci/run)"])
    missing += missing_host_tools(*tools)
    if missing:
        pytest.fail("this test needs " + "; ".join(missing)
                    + ". To leave the root-only unit tests out on purpose, deselect them with -m 'not root'.",
                    pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before fixtures are set up: they may already need root
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("root")
    if marker is not None:
        require_root(*marker.args)


def _is_vm(item: pytest.Item) -> bool:
    return item.get_closest_marker("vm") is not None


def run_bounded(make: Callable[[], Any], bound_s: float) -> Any:
    """Run the coroutine ``make()`` returns to its end, failing it after ``bound_s`` (a hang, not a slow test)."""
    return asyncio.run(asyncio.wait_for(make(), bound_s))


@contextlib.contextmanager
def short_tmp_dir(prefix: str) -> Iterator[Path]:
    """A directory under /tmp with a short path: agent sockets live in it, and a Unix socket path has at most
    107 bytes (pytest's own tmp_path is too deep)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.asynccontextmanager
async def served_on_loopback(app: Any, graceful_s: float = 5) -> AsyncIterator[str]:
    """``app`` served by uvicorn on a free loopback port for the block; yields its base URL."""
    sock = bind_tcp("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="critical", timeout_graceful_shutdown=graceful_s))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


OWN_PROCESS_ENV = "FORKD_TEST_OWN_PROCESS"  # set in the pytest that run_in_own_process starts


def run_in_own_process(nodeid: str, timeout_s: float = 600) -> None:
    """Run the ``own_process`` test ``nodeid`` in a pytest of its own and fail with its output if it fails."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid],
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, OWN_PROCESS_ENV: nodeid},
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-6000:] + done.stderr[-2000:]


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the tests that will run count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that loads a native runtime which must not outlive it in the suite's process (Ray's driver)
    # runs only in the pytest run_in_own_process starts for it.
    own = [item for item in items if item.get_closest_marker("own_process") and
           os.environ.get(OWN_PROCESS_ENV) != item.nodeid]
    if own:
        items[:] = [item for item in items if item not in own]
        config.hook.pytest_deselected(items=own)
    vm_items = [item for item in items if _is_vm(item)]
    if not vm_items:
        return
    if os.environ.get(TESTS_ENV) == "unit":
        items[:] = [item for item in items if not _is_vm(item)]
        config.hook.pytest_deselected(items=vm_items)
        return
    missing = vm_prerequisites_missing()
    if missing:
        pytest.exit(f"{len(vm_items)} VM tests are selected but this host lacks: " + "; ".join(missing)
                    + f". Fix that, or run only the unit tests on purpose with {TESTS_ENV}=unit.",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """One line saying how many VM tests really ran, so a run without them cannot pass unnoticed."""
    outcomes: dict[str, int] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if report.when in ("call", "setup") and "vm" in getattr(report, "keywords", {}):
                if report.when == "setup" and outcome == "passed":
                    continue
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
    ran = outcomes.get("passed", 0) + outcomes.get("failed", 0)
    detail = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())) or "none selected"
    note = f" ({TESTS_ENV}=unit)" if os.environ.get(TESTS_ENV) == "unit" else ""
    terminalreporter.write_line(f"VM tests run: {ran}{note} — {detail}")


def vm_env_for(home: Path) -> dict[str, str]:
    env = os.environ.copy()
    env["FORKD_HOME"] = str(home)
    env["FORKD_SOCKET"] = str(home / "forkd.sock")
    env.pop("FORKD_URL", None)
    # Also a loopback TCP listener with a token of its own, as a networked daemon runs (tests/vm/test_fuzz_live.py).
    env["FORKD_LISTEN"] = f"127.0.0.1:{free_port()}"
    env["FORKD_TOKEN"] = secrets.token_hex(32)
    # nat guests' DNS relay goes to the "outside" namespace tests/vm/test_network.py makes, never off the host.
    env["FORKD_DNS"] = "192.168.250.2"
    env["FORKD_E2B_LISTEN"] = f"127.0.0.1:{free_port()}"  # the E2B front (tests/vm/test_e2b_clients.py)
    # Pulls and pushes reach the HTTP servers tests run on loopback (a private address needs naming).
    config = home / "forkd-test.toml"
    config.write_text('[transfers]\nallow_hosts = ["127.0.0.1"]\n\n'
                      f'[limits]\nmax_chain_depth = {SUITE_MAX_CHAIN_DEPTH}\n')
    env["FORKD_CONFIG"] = str(config)
    return env


def e2b_front(home: Path, env: dict[str, str]) -> tuple[str, str]:
    """The URL of the daemon's E2B front (``FORKD_E2B_LISTEN``) and an API key from its key file."""
    keys = (home / "e2b" / "api-keys").read_text().split()
    return f"http://{env['FORKD_E2B_LISTEN']}", next(k for k in keys if k.startswith("e2b_"))


@pytest.fixture
def zram() -> Iterator[str]:
    """A zram swap of 512 MiB for one test (its device's name), removed after; the test needs the
    ``root`` mark. Skips only where the kernel has no zram driver; a failed set-up fails."""
    reason = zram_swap.unavailable()
    if reason:
        pytest.skip(reason)
    with zram_swap.zram_swap(512 << 20) as device:
        yield device


@pytest.fixture
def e2b_sdk(daemon: Controller, forkd_home: Path, vm_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The unmodified E2B SDK in this process talks to the session daemon's E2B front (it reads its
    variables when a call is made)."""
    url, key = e2b_front(forkd_home, vm_env)
    for name, value in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key}.items():
        monkeypatch.setenv(name, value)


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


def start_daemon(home: Path, env: dict[str, str], socket: Path | None = None) -> tuple[subprocess.Popen[bytes], Controller]:
    """A real daemon process on ``home``, answering on its socket (``FORKD_SOCKET``'s unless ``socket`` names
    the one its config gives it; fails the test if it does not start)."""
    with open(home / "daemon.log", "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "forkd", "daemon"], env=env, stdout=log, stderr=log)
    controller = Controller(url=f"unix://{socket or env['FORKD_SOCKET']}")
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


@contextlib.contextmanager
def own_vm_daemon(prefix: str, idle_stop_s: float) -> Iterator[Controller]:
    """A real daemon of a test module's own on a fresh home under /var/tmp, with the default image built or
    reused and children idle-stopped after ``idle_stop_s``; stopped (its VMs with it) and removed after."""
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    env = vm_env_for(home)
    env["FORKD_IDLE_STOP_S"] = str(idle_stop_s)
    process, controller = start_daemon(home, env)
    try:
        controller.build_image(name="default")
        yield controller
    finally:
        stop_daemon(process, controller, home)
        shutil.rmtree(home, ignore_errors=True)


def _fake_image(cache: Path) -> None:
    """An image the fake backend boots: its files are never executed, only linked and hashed."""
    directory = Paths(home=cache, cache=cache, socket=cache / "s").images / "default"
    directory.mkdir(parents=True)
    for name in (KERNEL_FILE, INITRD_FILE, ROOTFS_FILE):
        (directory / name).write_bytes(name.encode())
    write_manifest(directory, {"name": "default", "key": "fake", "kernel_version": "6.12", "kernel_sha256": "0" * 64,
                               "agent_version": AGENT_VERSION, "created_at": 0.0, "size_bytes": 3,
                               "disk_size_mib": 1, "spec": {}, "inputs": {}})


@contextlib.contextmanager
def fake_daemon_on(home: Path, config: str = "") -> Iterator[Controller]:
    """A whole daemon process on the fake VMM backend (``vmm = "fake"``) with its own image, on ``home``
    (short: agent sockets live under it), its config file holding ``config``; stopped at the end."""
    env = vm_env_for(home)
    for variable in ("FORKD_LISTEN", "FORKD_E2B_LISTEN"):
        env.pop(variable, None)
    (home / "forkd.toml").write_text(config)
    env.update(FORKD_VMM="fake", FORKD_CACHE=str(home / "cache"), FORKD_CONFIG=str(home / "forkd.toml"))
    _fake_image(home / "cache")
    process, controller = start_daemon(home, env)
    try:
        yield controller
    finally:
        stop_daemon(process, controller, home)  # fails if a fake VMM process outlived the daemon


@pytest.fixture
def fake_home() -> Iterator[Path]:
    """Short: agent sockets live under it and a Unix socket path has at most 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="fkd-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon(forkd_home: Path, vm_env: dict[str, str]) -> Iterator[Controller]:
    """A real daemon process for the whole session; stopped (and its VMs with it) at the end."""
    missing = vm_prerequisites_missing()
    if missing:
        pytest.fail("VM tests cannot run here: " + "; ".join(missing))
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
#: Appended to the workloads snapshot's warm code: a name every context of its children must see.
WORKLOADS_WARM_MARK = "WARM_CODE_RAN = True\n"
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
def workloads_image(daemon: Controller, workloads_ca: tuple[Path, Path, Path]) -> str:
    """The real-workload image (scientific stack, matplotlib, PostgreSQL, the test CA), built once per cache."""
    ca, _, _ = workloads_ca
    daemon.build_image(on_progress=_progress, name=WORKLOADS_IMAGE, packages=WORKLOADS_PACKAGES,
                       ca_certs=[ca.read_text()])
    return WORKLOADS_IMAGE


@pytest.fixture(scope="session")
def workloads_snapshot(daemon: Controller, workloads_image: str) -> str:
    """A snapshot of the workloads image with numpy, pandas and sklearn imported and PostgreSQL running,
    seeded by the postgres recipe's warmup."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    # The recipes' own warmup command and warm code, as their users make the snapshot.
    warmup = subprocess.run([sys.executable, str(examples / "postgres_fixture.py"), "--print-warmup"], check=True,
                            capture_output=True, text=True, timeout=60).stdout.strip()
    pytest_recipe = [sys.executable, str(examples / "pytest_warm_fanout.py")]
    warm_flags = subprocess.run([*pytest_recipe, "--print-warm-flags"], check=True, capture_output=True, text=True,
                                timeout=60).stdout.split()
    warm_code = subprocess.run([*pytest_recipe, "--print-warm-code"], check=True, capture_output=True, text=True,
                               timeout=60).stdout
    daemon.create_snapshot(WORKLOADS_SNAPSHOT, on_progress=_progress, image=workloads_image, memory_mib=1024,
                           warm_modules=["sklearn", *warm_flags[1::2]], warm_code=warm_code + WORKLOADS_WARM_MARK,
                           warmup_cmd=warmup)
    return WORKLOADS_SNAPSHOT


TYPESCRIPT_SDK = Path(__file__).resolve().parents[1] / "sdk" / "typescript"


@pytest.fixture(scope="session")
def typescript_sdk() -> Path:
    """sdk/typescript, built by scripts/setup (npm ci, then openapi-typescript and tsc): fails, never skips,
    when node is missing or the build is missing or older than a source file."""
    if shutil.which("node") is None:
        pytest.fail("node is not installed: `bash scripts/setup` installs nodejs and builds sdk/typescript")
    built = TYPESCRIPT_SDK / "dist" / "src" / "index.js"
    sources = [*TYPESCRIPT_SDK.glob("src/**/*.ts"), *TYPESCRIPT_SDK.glob("test/**/*.ts"),
               *TYPESCRIPT_SDK.glob("examples/**/*.ts"), *TYPESCRIPT_SDK.glob("scripts/*.mjs"),
               Path(__file__).resolve().parents[1] / "docs" / "openapi.json"]
    if not built.is_file():
        pytest.fail(f"{built} is missing: build the TypeScript SDK (`bash scripts/setup`, or `npm run build` in "
                    f"{TYPESCRIPT_SDK})")
    stale = [str(path) for path in sources if path.stat().st_mtime > built.stat().st_mtime]
    if stale:
        pytest.fail(f"the TypeScript SDK build is older than {', '.join(stale[:3])}: run `npm run build` in "
                    f"{TYPESCRIPT_SDK} (scripts/setup does)")
    return TYPESCRIPT_SDK


def node_tests(sdk: Path, directory: str, env: dict[str, str], timeout_s: float) -> None:
    """Run the compiled node tests in dist/test/DIRECTORY; fail with their report unless every one passed."""
    done = subprocess.run(["node", "--test", "--test-concurrency=1", "--test-reporter=spec",
                           f"dist/test/{directory}/"], cwd=sdk, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    report = done.stdout + done.stderr
    counts = dict(re.findall(r"^ℹ (tests|pass|fail|skipped|todo|cancelled) (\d+)$", report, re.MULTILINE))
    print(report)  # shown with -s or -rA: every node test by name
    passed = int(counts.get("pass", "0"))
    assert done.returncode == 0 and passed > 0 and counts.get("tests") == str(passed), \
        f"node --test exited {done.returncode} ({counts}: every test must pass, none skipped):\n{report[-12000:]}"


@pytest.fixture
def qemu_sandbox_service() -> Callable[[Paths, Registry], SandboxService]:
    """A factory: the real SandboxService over ``paths`` and ``registry``, with the QEMU backend (never started)."""

    def make(paths: Paths, registry: Registry) -> SandboxService:
        vmm = create_vmm("qemu")
        return SandboxService(paths, registry, vmm, Isolation.from_options(registry, RuntimeOptions()))

    return make
