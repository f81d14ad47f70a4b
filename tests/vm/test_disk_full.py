"""A host disk that fills under a running guest: the guest gets EIO and keeps answering (QEMU's default
would pause it), and the next fork is refused with ``disk_full`` (the daemon's free-space floor).

The children's run directories (their qcow2 overlays) are put on a small tmpfs this test mounts.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_faults import Daemon, bake, own_home

from forkd.sdk.controller import ForkdError

pytestmark = pytest.mark.vm
TAG = "diskfull"
SANDBOXES_MIB = 96  # the tmpfs the overlays grow on
FLOOR_MIB = 32  # [disk] min_free_mib of the daemon under test


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    yield from own_home("forkd-diskfull-")


def test_a_child_that_fills_the_host_disk_gets_eio_answers_and_the_next_fork_is_disk_full(home: Path) -> None:
    bake(home, TAG, memory_mib=256, warm_modules=[])
    sandboxes = home / "sandboxes"
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SANDBOXES_MIB}m", "tmpfs", str(sandboxes)], check=True)
    config = home / "forkd.toml"
    config.write_text(f"[disk]\nmin_free_mib = {FLOOR_MIB}\n")
    daemon = Daemon(home, "--config", str(config))
    try:
        daemon.start()
        client = daemon.controller
        [child] = client.fork(TAG, 1)["sandboxes"]
        sandbox_id = child["id"]
        # Direct I/O, so the failed host write comes back to dd itself instead of to a later writeback.
        filled = client.exec(sandbox_id, f"dd if=/dev/zero of=/root/fill bs=1M count={4 * SANDBOXES_MIB} "
                                         "oflag=direct", timeout_s=600)
        print(f"\ndd in the guest: exit {filled['exit_code']}: {filled['stderr'][-300:]}")
        assert filled["exit_code"] != 0 and "Input/output error" in filled["stderr"], filled
        assert client.exec(sandbox_id, "true", timeout_s=120)["exit_code"] == 0  # not paused: it answers
        assert client.exec(sandbox_id, "echo still here", timeout_s=120)["stdout"] == "still here\n"
        with pytest.raises(ForkdError) as refused:
            client.fork(TAG, 1)
        print(f"the next fork: {refused.value.status} {refused.value.code}: {refused.value.message}")
        assert (refused.value.status, refused.value.code) == (507, "disk_full"), refused.value.message
        assert str(sandboxes) in refused.value.message and "[disk] min_free_mib" in refused.value.message
        assert [s["id"] for s in client.sandboxes()] == [sandbox_id]
        client.kill(sandbox_id)
    finally:
        daemon.stop()
        subprocess.run(["umount", str(sandboxes)], check=False)
