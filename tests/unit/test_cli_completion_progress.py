"""The CLI's completion of ids and tags, its ``--label`` filters, and its progress with byte counts, against a
whole daemon on the fake backend (completion through the real entry point, as a shell runs it)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from conftest import fake_daemon_on
from forkd.cli import common
from forkd.cli.main import cli
from forkd.sdk.controller import Controller
from forkd.sdk.progress import ProgressLine


@pytest.fixture
def daemon(fake_home: Path) -> Iterator[Controller]:
    with fake_daemon_on(fake_home) as running:
        running.create_snapshot("base", memory_mib=256, warm_modules=[])
        yield running


def _env(home: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("FORKD_")}
    return {**env, "FORKD_HOME": str(home), "FORKD_SOCKET": str(home / "forkd.sock")}


def complete(home: Path, line: str) -> list[str]:
    """What bash completion offers for the last word of ``line`` (Click's own protocol)."""
    words = line.split(" ")
    done = subprocess.run([sys.executable, "-m", "forkd"], capture_output=True, text=True, timeout=60,
                          env={**_env(home), "_FORKD_COMPLETE": "bash_complete", "COMP_WORDS": line,
                               "COMP_CWORD": str(len(words) - 1)})
    assert done.returncode == 0, done.stderr
    return [entry.split(",", 1)[1] for entry in done.stdout.splitlines() if entry]


def test_completion_offers_running_sandbox_ids_and_ready_tags(daemon: Controller, fake_home: Path) -> None:
    sandbox = daemon.fork("base", 1)["sandboxes"][0]["id"]
    assert complete(fake_home, "forkd exec ") == [sandbox]
    assert complete(fake_home, "forkd kill sb-") == [sandbox]
    assert complete(fake_home, "forkd kill x") == []
    assert complete(fake_home, "forkd fork --tag ") == ["base"]
    assert complete(fake_home, "forkd snapshot info b") == ["base"]
    assert complete(fake_home, "forkd snapshot-info ") == ["base"]  # an older spelling completes the same
    assert complete(fake_home, "forkd snapshot create --tag ") == []  # a new name: nothing to offer
    daemon.kill(sandbox)
    assert complete(fake_home, "forkd exec ") == []  # ended sandboxes are not offered


def test_completion_without_a_daemon_offers_nothing_and_starts_none(fake_home: Path) -> None:
    assert complete(fake_home, "forkd exec ") == []
    assert not (fake_home / "forkd.sock").exists() and not (fake_home / "daemon.out").exists()


def test_label_filters_select_what_ps_lists_and_kill_kills(daemon: Controller, fake_home: Path) -> None:
    env = _env(fake_home)
    team_a = daemon.fork("base", 2, metadata={"team": "a"})["sandboxes"]
    team_b = daemon.fork("base", 1, metadata={"team": "b", "job": "7"})["sandboxes"]
    runner = CliRunner()
    listed = runner.invoke(cli, ["ps", "-q", "--label", "team=a"], env=env)
    assert listed.exit_code == 0 and sorted(listed.stdout.split()) == sorted(s["id"] for s in team_a)
    both = runner.invoke(cli, ["ps", "-q", "-l", "team=b", "-l", "job=7"], env=env)
    assert both.stdout.split() == [team_b[0]["id"]]
    assert runner.invoke(cli, ["ps", "-q", "-l", "team=b", "-l", "job=8"], env=env).stdout == ""
    assert runner.invoke(cli, ["ps", "--label", "team"], env=env).exit_code == 2  # KEY=VALUE or nothing

    killed = runner.invoke(cli, ["kill", "--label", "team=a"], env=env)
    assert killed.exit_code == 0, killed.output
    assert {s["id"] for s in daemon.sandboxes()} == {team_b[0]["id"]}
    assert runner.invoke(cli, ["kill", team_b[0]["id"], "--all"], env=env).exit_code == 2  # ids or a selection


def test_pack_progress_carries_byte_counts_to_the_sdk(daemon: Controller, fake_home: Path) -> None:
    lines: list[str] = []
    daemon.pack("base", str(fake_home / "packs" / "base.fkpack"), on_progress=lines.append)
    measured = [line for line in lines if isinstance(line, ProgressLine) and line.done_bytes is not None]
    assert measured, lines
    assert all(0 <= line.done_bytes <= (line.total_bytes or line.done_bytes) for line in measured)  # type: ignore[operator]
    assert measured[-1].total_bytes and measured[-1].done_bytes == measured[-1].total_bytes
    assert any(line.done_bytes is None for line in lines if isinstance(line, ProgressLine))  # plain steps too


def test_a_terminal_shows_a_bar_with_speed_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=screen, force_terminal=True, width=160))
    with common.progress_display() as show:
        show(ProgressLine("packing base"))
        show(ProgressLine("packed 1 of 4 MiB (25%)", 1 << 20, 4 << 20))
        show(ProgressLine("packed 4 of 4 MiB (100%)", 4 << 20, 4 << 20))
    shown = screen.getvalue()
    assert "packing base" in shown  # a step without counts is printed above the bar
    assert "packed" in shown and "4.2/4.2 MB" in shown and "/s" in shown  # bytes done/total and a speed
