"""Workspaces on real guests: suspend frees the VMM, resume brings back processes, files and state."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forkd.sdk.controller import Controller, ForkdError

pytestmark = pytest.mark.vm


def test_suspend_frees_the_vmm_and_resume_restores_the_state(daemon: Controller, snapshot_tag: str,
                                                               vm_env: dict[str, str]) -> None:
    info = daemon.create_workspace("notebook", snapshot_tag)
    try:
        first = info["sandbox_id"]
        daemon.run_code(first, "history = ['step 1']")
        daemon.write_file(first, "/root/work.txt", b"draft 1\n")
        daemon.exec(first, "nohup sleep 86399 >/dev/null 2>&1 &")  # 86400 is the warm-up's own
        pid = daemon.sandbox(first)["pid"]

        suspended = daemon.suspend_workspace("notebook")
        assert (suspended["state"], suspended["sandbox_id"], suspended["snapshot_tag"]) == (
            "suspended", None, "ws-notebook-1")
        assert first not in [s["id"] for s in daemon.sandboxes()]
        assert not Path(f"/proc/{pid}").exists()  # its VMM and memory are gone
        with pytest.raises(ForkdError) as twice:
            daemon.suspend_workspace("notebook")
        assert twice.value.status == 409

        resumed = daemon.resume_workspace("notebook")
        second = resumed["sandbox_id"]
        assert resumed["state"] == "running" and second != first
        assert daemon.eval(second, "history")["value_json"] == ["step 1"]
        assert daemon.read_file(second, "/root/work.txt") == b"draft 1\n"
        commands = daemon.exec(second, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")["stdout"]
        assert "sleep 86399" in commands  # the process started before the suspend runs again

        daemon.run_code(second, "history.append('step 2')")  # a second cycle stacks a second layer
        daemon.suspend_workspace("notebook")
        third = daemon.resume_workspace("notebook")["sandbox_id"]
        assert daemon.eval(third, "history")["value_json"] == ["step 1", "step 2"]
        listed = subprocess.run([sys.executable, "-m", "forkd", "workspace", "ls"], env=vm_env, capture_output=True,
                                text=True, timeout=120)
        assert listed.returncode == 0 and "notebook" in listed.stdout and "running" in listed.stdout
    finally:
        removed = daemon.remove_workspace("notebook")
    assert sorted(removed) == ["ws-notebook-1", "ws-notebook-2"]
    assert not {"ws-notebook-1", "ws-notebook-2"} & {s["tag"] for s in daemon.snapshots()}
    with pytest.raises(ForkdError) as gone:
        daemon.workspace("notebook")
    assert gone.value.status == 404


def test_bad_workspace_requests(daemon: Controller, snapshot_tag: str) -> None:
    for name in ("../x", "x" * 41, ""):
        with pytest.raises(ForkdError) as bad:
            daemon.create_workspace(name, snapshot_tag)
        assert bad.value.status == 400, name
    with pytest.raises(ForkdError) as missing:
        daemon.resume_workspace("nope")
    assert missing.value.status == 404 and "forkd workspace ls" in missing.value.message
