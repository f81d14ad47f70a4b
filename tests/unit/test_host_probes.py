"""Host probes against this machine's real kernel, and `forkd doctor` against real HTTP endpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from forkd.config import Paths
from forkd.host import probes
from forkd.host.doctor import run_checks


def test_cgroup_layouts_are_told_apart(tmp_path: Path) -> None:
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("cpu memory pids\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup2 {unified} cgroup2 rw,nosuid 0 0\n")
    assert probes.probe_cgroups(mounts) == probes.Cgroups("v2", ("cpu", "memory", "pids"), ())
    (unified / "cgroup.controllers").write_text("hugetlb\n")
    mounts.write_text(f"cgroup2 {unified} cgroup2 rw 0 0\ncgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"
                      "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n")
    hybrid = probes.probe_cgroups(mounts)
    assert hybrid.version == "hybrid" and hybrid.missing == ["pids"]
    mounts.write_text("proc /proc proc rw 0 0\n")
    assert probes.probe_cgroups(mounts).version == "none"


def test_kernel_probes_agree_with_the_kernel() -> None:
    assert probes.probe_memfd() is None
    if Path("/dev/net/tun").exists() and os.geteuid() == 0:
        assert probes.probe_tun() is None
    if os.geteuid() == 0:
        assert probes.probe_netns() is None
    assert probes.meminfo()["MemTotal"] > 0


def test_every_check_has_a_fix_when_not_ok(tmp_path: Path) -> None:
    checks = run_checks(Paths(home=tmp_path / "home", cache=tmp_path / "cache", socket=tmp_path / "s.sock"))
    names = {c.name for c in checks}
    assert {"platform", "accelerator", "qemu", "cgroups", "netns", "tun", "nft", "ip_forward", "soft_dirty",
            "memfd", "ksm", "hugepages", "free disk (home)", "free disk (cache)", "free memory"} <= names
    assert all(c.fix for c in checks if c.status != "ok"), [c for c in checks if c.status != "ok" and not c.fix]
    assert next(c for c in checks if c.name == "image cache").status == "warn"  # an empty cache


def _doctor(env: dict[str, str]) -> tuple[int, list[dict[str, str]]]:
    done = subprocess.run([sys.executable, "-m", "forkd", "doctor", "--json"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    return done.returncode, json.loads(done.stdout)


def test_doctor_without_a_daemon_does_not_start_one(tmp_path: Path) -> None:
    socket = tmp_path / "forkd.sock"
    _, checks = _doctor({"FORKD_HOME": str(tmp_path), "FORKD_SOCKET": str(socket), "FORKD_URL": ""})
    daemon = next(c for c in checks if c["name"] == "daemon")
    assert daemon["status"] == "warn" and "forkd daemon" in daemon["fix"]
    assert not socket.exists()


@pytest.fixture
def rejecting_server() -> str:
    """A real HTTP endpoint that refuses every request with 401, as a daemon with a token does."""
    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = b'{"error": {"code": "unauthorized", "message": "missing or wrong bearer token"}}'
            self.send_response(401)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_doctor_reports_a_rejected_token(tmp_path: Path, rejecting_server: str) -> None:
    code, checks = _doctor({"FORKD_HOME": str(tmp_path), "FORKD_URL": rejecting_server, "FORKD_TOKEN": "wrong"})
    daemon = next(c for c in checks if c["name"] == "daemon")
    assert code == 1 and daemon["status"] == "fail" and daemon["detail"] == "token rejected"
