"""One daemon per host: clients find the daemon through its config file, a second daemon on the same
state directory refuses, read-only commands never start one, systemd hears READY=1 once the socket serves,
and a daemon the CLI started logs to a rotated file. Real daemon processes on the fake backend, the real
``forkd`` entry point in subprocesses (so nothing of this test's environment leaks in)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import _fake_image, start_daemon, stop_daemon
from forkd.config import ConfigFileError, Paths, paths_from_env
from forkd.sdk.autostart import _daemon_env

CLEARED = ("FORKD_HOME", "FORKD_SOCKET", "FORKD_URL", "FORKD_CONFIG", "FORKD_LISTEN", "FORKD_E2B_LISTEN",
           "FORKD_TOKEN", "FORKD_LOG_FILE", "FORKD_CACHE", "FORKD_VMM", "NOTIFY_SOCKET")


def clean_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in CLEARED}
    env.update(extra)
    return env


def forkd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forkd", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def daemons_of(config: Path) -> list[int]:
    """Pids of ``forkd daemon`` processes started with this config file (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"daemon" in argv and f"FORKD_CONFIG={config}".encode() in environ:
            found.append(int(entry.name))
    return found


@pytest.fixture
def systemd_style(fake_home: Path) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """A daemon configured only by its file (socket elsewhere than HOME/forkd.sock, as under systemd), which
    told a NOTIFY_SOCKET it is ready; yields (config, its socket, a client env naming only the config)."""
    config = fake_home / "forkd.toml"
    run_socket = fake_home / "run" / "forkd.sock"
    config.write_text(f'home = "{fake_home}"\ncache = "{fake_home / "cache"}"\nsocket = "{run_socket}"\n'
                      'vmm = "fake"\n')
    _fake_image(fake_home / "cache")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(fake_home / "notify"))
    notify.settimeout(30)
    env = clean_env(FORKD_CONFIG=str(config))
    process, controller = start_daemon(fake_home, {**env, "NOTIFY_SOCKET": str(fake_home / "notify")}, run_socket)
    try:
        assert notify.recv(64) == b"READY=1"  # sent once the socket serves (the daemon answered health already)
        yield config, run_socket, env
    finally:
        notify.close()
        stop_daemon(process, controller, fake_home)


def test_clients_find_a_systemd_style_daemon_and_no_second_one_starts(systemd_style, fake_home: Path) -> None:
    config, run_socket, env = systemd_style
    assert not (fake_home / "forkd.sock").exists()
    listed = forkd(env, "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []
    killed = forkd(env, "kill", "--all")  # a command that would start a daemon when none answered
    assert killed.returncode == 0, killed.stderr
    assert len(daemons_of(config)) == 1
    assert not (fake_home / "daemon.out").exists()  # the autostart never ran

    # A second daemon on the same home, even on another socket, refuses and names the first.
    second = forkd(env, "daemon", "--socket", str(fake_home / "other.sock"))
    assert second.returncode == 1
    lock = json.loads((fake_home / "daemon.lock").read_text())
    assert f"pid {lock['pid']}" in second.stderr and str(run_socket) in second.stderr
    assert "another forkd daemon" in second.stderr and not (fake_home / "other.sock").exists()
    assert len(daemons_of(config)) == 1


def test_read_only_commands_never_start_a_daemon(fake_home: Path) -> None:
    env = clean_env(FORKD_HOME=str(fake_home), FORKD_VMM="fake", FORKD_CACHE=str(fake_home / "cache"))
    for args in (("ls",), ("ps", "-q"), ("snapshot", "ls"), ("snapshot", "info", "base"), ("image", "ls"),
                 ("workspace", "ls"), ("sandbox", "inspect", "sb-000000000000"), ("ls", "--pool")):
        result = forkd(env, *args)
        assert result.returncode == 1, (args, result.stdout)
        assert "cannot reach the forkd daemon" in result.stderr and "forkd daemon" in result.stderr
    assert not (fake_home / "forkd.sock").exists() and not (fake_home / "daemon.out").exists()


def test_a_cli_started_daemon_logs_to_a_rotated_file(fake_home: Path) -> None:
    _fake_image(fake_home / "cache")
    env = clean_env(FORKD_HOME=str(fake_home), FORKD_VMM="fake", FORKD_CACHE=str(fake_home / "cache"))
    started = forkd(env, "kill", "--all")  # starts the daemon, which then outlives the command
    assert started.returncode == 0, started.stderr
    pid = json.loads((fake_home / "daemon.lock").read_text())["pid"]
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"FORKD_LOG_FILE={fake_home / 'daemon.log'}".encode() in environ
        assert "ready: serving on" in (fake_home / "daemon.log").read_text()
        assert (fake_home / "daemon.out").read_text() == ""  # nothing printed outside logging
    finally:
        os.kill(pid, signal.SIGTERM)
    # Not our child (the CLI detached it): its lock comes free once it exited.
    probe = subprocess.run(["flock", "-w", "60", str(fake_home / "daemon.lock"), "true"], timeout=90)
    assert probe.returncode == 0  # the lock is free: the daemon exited


def test_the_autostart_keeps_a_log_file_the_config_names(tmp_path: Path) -> None:
    paths = Paths(home=tmp_path, cache=tmp_path, socket=tmp_path / "s")
    config = tmp_path / "forkd.toml"
    config.write_text('log_file = "/var/log/forkd/daemon.log"\n')
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("FORKD_LOG_FILE", raising=False)
        patch.setenv("FORKD_CONFIG", str(config))
        assert "FORKD_LOG_FILE" not in _daemon_env(paths)
        config.write_text("")
        assert _daemon_env(paths)["FORKD_LOG_FILE"] == str(tmp_path / "daemon.log")


def test_client_paths_follow_the_daemons_precedence(tmp_path: Path) -> None:
    config = tmp_path / "forkd.toml"
    config.write_text('home = "/srv/forkd"\nsocket = "/run/forkd/forkd.sock"\n')
    assert paths_from_env({"FORKD_CONFIG": str(config)}).socket == Path("/run/forkd/forkd.sock")
    assert paths_from_env({"FORKD_CONFIG": str(config), "FORKD_SOCKET": "/tmp/x.sock"}).socket == Path("/tmp/x.sock")
    config.write_text('home = "/srv/forkd"\n')
    assert paths_from_env({"FORKD_CONFIG": str(config)}).socket == Path("/srv/forkd/forkd.sock")
    assert paths_from_env({"FORKD_CONFIG": str(config), "FORKD_HOME": "/h"}).socket == Path("/h/forkd.sock")
    config.write_text("home = [")
    with pytest.raises(ConfigFileError, match="not valid TOML"):
        paths_from_env({"FORKD_CONFIG": str(config)})
    bad = forkd(clean_env(FORKD_CONFIG=str(config)), "ls")
    assert bad.returncode == 1 and "not valid TOML" in bad.stderr and "Traceback" not in bad.stderr


def test_check_config_reports_the_effective_settings_or_the_bad_key(tmp_path: Path) -> None:
    config = tmp_path / "forkd.toml"
    config.write_text(f'home = "{tmp_path}"\nsocket = "{tmp_path}/d.sock"\nlog_format = "json"\n')
    good = forkd(clean_env(FORKD_CONFIG=str(config)), "daemon", "--check-config")
    assert good.returncode == 0, good.stderr
    assert f"socket {tmp_path}/d.sock" in good.stdout and "(json)" in good.stdout
    assert not (tmp_path / "d.sock").exists() and not (tmp_path / "daemon.lock").exists()  # nothing started
    config.write_text('homedir = "/x"\n')
    bad = forkd(clean_env(FORKD_CONFIG=str(config)), "daemon", "--check-config")
    assert bad.returncode == 1 and "homedir" in bad.stderr
