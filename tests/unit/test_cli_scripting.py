"""The ``forkd`` CLI as scripts use it, against a whole daemon on the fake backend: plain tab-separated rows
off a terminal, ``--json`` and ``-q`` on the listings, errors on stderr (JSON under ``--json``), and
``forkd exec``'s status 125 when forkd itself failed. Exec's stdin and 126/127 need a guest:
tests/vm/test_cli_exec.py."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from conftest import fake_daemon_on
from forkd.cli.main import cli
from forkd.sdk.controller import Controller

#: Longer than the column an 80-column box table would give it: a table cuts it with an ellipsis.
LONG_TAG = "a-tag-longer-than-a-table-cell"
GONE = "sb-000000000000"


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="fkc-", dir="/tmp"))  # short: agent sockets live under it
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def controller(home: Path) -> Iterator[Controller]:
    with fake_daemon_on(home) as running:
        running.create_snapshot(LONG_TAG, memory_mib=256, warm_modules=[])
        yield running


@pytest.fixture
def forkd(home: Path, controller: Controller):  # type: ignore[no-untyped-def]
    """``forkd ARGS`` in this process with the daemon's socket, stdout and stderr kept apart."""
    env = {"FORKD_HOME": str(home), "FORKD_SOCKET": str(home / "forkd.sock"), "FORKD_URL": None}

    def run(*args: str, input: str | None = None) -> Result:
        return CliRunner().invoke(cli, list(args), env=env, input=input)
    return run


def test_listings_off_a_terminal_are_whole_tab_separated_rows(forkd, controller: Controller) -> None:
    listed = forkd("snapshots")
    assert listed.exit_code == 0, listed.output
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    assert [row[0] for row in rows] == [LONG_TAG]  # no header, no box, nothing cut
    assert rows[0][1:3] == ["-", "ready"] and len(rows[0]) == 10
    assert rows[0][9] == "q35"  # the machine type, last: the columns before it keep their places
    assert not set("┃━│…") & set(listed.stdout)
    assert forkd("images").stdout == listed.stdout  # the other name lists the same

    sandbox = controller.fork(LONG_TAG, 1)["sandboxes"][0]["id"]
    try:
        ls = forkd("ls")
        row = next(line.split("\t") for line in ls.stdout.splitlines() if line.startswith(sandbox))
        assert row[:3] == [sandbox, LONG_TAG, "running"], ls.stdout
    finally:
        controller.kill(sandbox)


def test_json_and_quiet_on_the_listings(forkd, controller: Controller) -> None:
    assert [item["tag"] for item in json.loads(forkd("snapshots", "--json").stdout)] == [LONG_TAG]
    assert forkd("snapshots", "-q").stdout == f"{LONG_TAG}\n"
    assert forkd("images", "--quiet").stdout == f"{LONG_TAG}\n"
    assert forkd("image", "ls", "-q").stdout == "default\n"
    assert json.loads(forkd("image", "ls", "--json").stdout)[0]["name"] == "default"
    info = json.loads(forkd("snapshot-info", LONG_TAG, "--json").stdout)
    assert info["status"] == "ready" and info["depth"] == 0


def test_fork_quiet_prints_just_the_ids_for_a_shell_variable(forkd, controller: Controller) -> None:
    one = forkd("fork", "--tag", LONG_TAG, "-q")
    assert one.exit_code == 0, one.output
    sandbox = one.stdout.strip()
    assert one.stdout == f"{sandbox}\n" and sandbox.startswith("sb-")  # SB=$(forkd fork --tag T -q)
    two = forkd("fork", "--tag", LONG_TAG, "-n", "2", "-q")
    ids = two.stdout.split()
    assert two.exit_code == 0 and len(ids) == 2 and two.stdout == "".join(f"{i}\n" for i in ids)
    try:
        assert sorted(forkd("ls", "-q").stdout.split()) == sorted([sandbox, *ids])
        assert {item["id"] for item in json.loads(forkd("ls", "--json").stdout)} == {sandbox, *ids}
        plain = forkd("fork", "--tag", LONG_TAG)  # the summary goes to stderr, so stdout holds only the child line
        assert plain.exit_code == 0 and plain.stdout.startswith("sb-") and len(plain.stdout.splitlines()) == 1
        assert "1/1 children answering" in plain.stderr
    finally:
        assert forkd("kill", "--all").exit_code == 0
    assert forkd("ls", "-q").stdout == ""


def test_workspaces_list_quiet_json_and_plain(forkd, controller: Controller) -> None:
    created = json.loads(forkd("workspace", "create", "notes", "--tag", LONG_TAG, "--json").stdout)
    try:
        assert created["name"] == "notes" and created["state"] == "running"
        assert forkd("workspace", "ls", "-q").stdout == "notes\n"
        assert forkd("workspace", "ls").stdout.split("\t")[:3] == ["notes", "running", created["sandbox_id"]]
    finally:
        assert forkd("workspace", "rm", "notes").exit_code == 0


def test_errors_go_to_stderr_and_in_json_under_json(forkd) -> None:
    plain = forkd("snapshot-info", "no-such-tag")
    assert plain.exit_code == 1 and plain.stdout == "" and "error:" in plain.stderr
    as_json = forkd("snapshot-info", "no-such-tag", "--json")
    assert as_json.exit_code == 1 and as_json.stdout == ""
    error = json.loads(as_json.stderr)["error"]
    assert error["code"] == "not_found" and error["status"] == 404 and "no-such-tag" in error["message"]


def test_exec_status_is_the_commands_own_and_125_when_forkd_failed(forkd, controller: Controller,
                                                                   home: Path) -> None:
    sandbox = controller.fork(LONG_TAG, 1)["sandboxes"][0]["id"]
    try:
        assert forkd("exec", sandbox, "--", "true").exit_code == 0  # the fake guest's stub answer: status 0
        result = json.loads(forkd("exec", sandbox, "--json", "--", "true").stdout)
        assert result["exit_code"] == 0
    finally:
        controller.kill(sandbox)
    unknown = forkd("exec", GONE, "--", "true")
    assert unknown.exit_code == 125 and GONE in unknown.stderr
    unknown_json = forkd("exec", GONE, "--json", "--", "true")
    assert unknown_json.exit_code == 125 and json.loads(unknown_json.stderr)["error"]["code"] == "not_found"
    unreachable = CliRunner().invoke(cli, ["exec", sandbox, "--", "true"],
                                     env={"FORKD_URL": f"unix://{home}/no-daemon.sock"})
    assert unreachable.exit_code == 125 and "cannot reach the forkd daemon" in unreachable.stderr


def test_kill_all_goes_on_past_sandboxes_that_already_ended(forkd, controller: Controller,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = controller.fork(LONG_TAG, 1)["sandboxes"][0]["id"]
    listed = Controller.sandboxes
    # One that ended between the listing and its kill (a timeout, another client's kill), listed first.
    monkeypatch.setattr(Controller, "sandboxes", lambda self: [{"id": GONE}, *listed(self)])
    killed = forkd("kill", "--all")
    assert killed.exit_code == 0, killed.output
    assert killed.stdout == f"killed {sandbox}\n"
    monkeypatch.undo()
    assert controller.sandboxes() == []
    other = controller.fork(LONG_TAG, 1)["sandboxes"][0]["id"]
    named = forkd("kill", GONE, other)  # named ids: an unknown one is an error, the others are still killed
    assert named.exit_code == 1 and GONE in named.stderr and named.stdout == f"killed {other}\n"
    assert controller.sandboxes() == []


def test_dash_h_is_help_everywhere(forkd) -> None:
    for args in (["-h"], ["fork", "-h"], ["exec", "-h"], ["workspace", "ls", "-h"]):
        shown = forkd(*args)
        assert shown.exit_code == 0 and shown.stdout.startswith("Usage:"), (args, shown.output)
    assert "-i, --interactive" in forkd("exec", "-h").stdout


def test_resource_groups_and_the_old_names_hidden_but_working(forkd, controller: Controller) -> None:
    assert forkd("snapshot", "ls", "-q").stdout == f"{LONG_TAG}\n"
    assert json.loads(forkd("snapshot", "info", LONG_TAG, "--json").stdout)["depth"] == 0
    sandbox = forkd("fork", "--tag", LONG_TAG, "-q").stdout.strip()
    assert forkd("ps", "-q").stdout == forkd("sandbox", "ls", "-q").stdout == forkd("ls", "-q").stdout == f"{sandbox}\n"
    inspected = json.loads(forkd("sandbox", "inspect", sandbox).stdout)
    assert inspected["id"] == sandbox and inspected["snapshot_tag"] == LONG_TAG
    for tag in ("layer-1", "layer-2"):
        assert forkd("branch", sandbox, "--tag", tag).exit_code == 0
    assert forkd("snapshot", "rm", "layer-2").stdout == "removed snapshot layer-2\n"  # layer-1 is its parent
    assert forkd("rmi", "layer-1").stdout == "removed snapshot layer-1\n"
    assert forkd("sandbox", "rm", sandbox).stdout == f"killed {sandbox}\n"
    assert json.loads(forkd("sandbox", "inspect", sandbox).stdout)["status"] != "running"  # its record stays

    shown = forkd("-h").stdout
    listed = {line.split()[0] for line in shown.split("Commands:")[1].splitlines() if line.strip()}
    assert {"snapshot", "sandbox", "ps", "fork", "exec", "kill"} <= listed
    assert not {"snapshots", "images", "rmi", "snapshot-info", "snapshot-diff", "snapshot-compact", "ls"} & listed
    for old in (["snapshots"], ["images"], ["snapshot-info", LONG_TAG]):  # hidden, still there
        assert forkd(*old).exit_code == 0, old
    assert forkd("snapshot-compact", "-h").stdout.startswith("Usage:")


def test_exec_status_follows_the_errno_the_guest_sent() -> None:
    from forkd.cli.execute import status_for
    from forkd.sdk.errors import ForkdError

    def failed(message: str, **details: object) -> ForkdError:
        return ForkdError(404, "not_found", message, details)

    assert status_for(failed("[Errno 2] No such file or directory: 'nope'", errno="ENOENT"), None) == 127
    assert status_for(failed("[Errno 2] No such file or directory: '/w'", errno="ENOENT"), "/w") == 126
    assert status_for(failed("[Errno 2] No such file or directory: 'nope'", errno="ENOENT"), "/w") == 127
    assert status_for(failed("[Errno 13] Permission denied: '/tmp/x'", errno="EACCES"), None) == 126
    assert status_for(failed("no running sandbox 'sb-000000000000'"), None) == 125  # no errno: forkd's own
