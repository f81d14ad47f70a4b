"""E2B pause/resume cycles on real guests keep a bounded chain of layers and lose nothing: the unmodified
E2B Python SDK, pointed at the session daemon's E2B front (tests/conftest.py runs it with
``[e2b] max_pause_chain = 3``), pauses and resumes one sandbox 12 times; after every pause the daemon's
own snapshot info says how deep the chain it will resume from is, and after every resume the files, a
background process and the shell's history of cycles are there."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm

BOUND = 3  # tests/conftest.py's [e2b] max_pause_chain
CYCLES = 12


def test_twelve_pauses_keep_the_chain_bounded_and_every_kind_of_state(
        daemon: Controller, snapshot_tag: str, vm_env: dict[str, str], forkd_home: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox  # the E2B SDK reads its variables when a call is made

    url = f"http://{vm_env['FORKD_E2B_LISTEN']}"
    key = next(k for k in (forkd_home / "e2b" / "api-keys").read_text().split() if k.startswith("e2b_"))
    for name, value in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key}.items():
        monkeypatch.setenv(name, value)
    sbx = Sandbox.create(template=snapshot_tag, timeout=900)
    try:
        sbx.files.write("/tmp/in-memory", "tmpfs state")
        sbx.files.write("/root/on-disk", "disk state")
        sleeper = sbx.commands.run("sleep 100000 >/dev/null 2>&1 & echo $!").stdout.strip()
        depths = []
        for cycle in range(CYCLES):
            sbx.commands.run(f"echo {cycle} >> /root/cycles")
            assert sbx.pause() is True
            snapshot = daemon.snapshot(daemon.workspace(sbx.sandbox_id)["snapshot_tag"])
            depths.append(snapshot["depth"])
            sbx = Sandbox.connect(sbx.sandbox_id, timeout=900)
            assert sbx.files.read("/tmp/in-memory") == "tmpfs state"
            assert sbx.files.read("/root/on-disk") == "disk state"
            assert sbx.commands.run(f"kill -0 {sleeper}").exit_code == 0  # the process lives on
            assert sbx.files.read("/root/cycles").split() == [str(n) for n in range(cycle + 1)]
        # Without the bound the depths are 1, 2, ..., 12; with it never past 3, a compacted layer (depth 0,
        # standalone) every fourth pause.
        assert max(depths) <= BOUND and depths.count(0) >= 2, depths
    finally:
        sbx.kill()
