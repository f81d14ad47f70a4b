"""Eight uploads to a guest that stopped (its QEMU is SIGSTOPped): the daemon's spool holds at most its
budget's bytes in at most its budget's files, then every upload completes once the guest runs again."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_faults import Daemon, bake, own_home, wait_until

from forkd.sdk.controller import Controller

pytestmark = pytest.mark.vm
TAG = "spool"
UPLOADS, UPLOAD_MIB = 8, 24
SPOOL_MIB, SPOOL_FILES = 32, 4
MIB = 1 << 20
FS_SLACK = 64 << 10  # per file: a filesystem may count a block of its own metadata in st_blocks


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    yield from own_home("forkd-spool-")


def _spool(pid: int, uploads: Path) -> list[int]:
    """Bytes allocated by each file the daemon holds open under ``uploads`` (its spool files)."""
    sizes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{uploads}/"):
                sizes.append(os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512)
        except OSError:  # closed while listing
            continue
    return sizes


def _pieces(index: int) -> Iterator[bytes]:
    for _ in range(UPLOAD_MIB):
        yield bytes([index]) * MIB


def test_uploads_to_a_stopped_guest_stay_within_the_spool_budget(home: Path) -> None:
    bake(home, TAG, memory_mib=256, warm_modules=[])
    config = home / "forkd.toml"
    config.write_text(f"[uploads]\nspool_mib = {SPOOL_MIB}\nspool_files = {SPOOL_FILES}\n")
    daemon = Daemon(home, "--config", str(config))
    stopped: int | None = None
    try:
        daemon.start()
        client = daemon.controller
        [child] = client.fork(TAG, 1)["sandboxes"]
        sandbox_id, stopped = child["id"], child["pid"]  # (the daemon's own command line names home too)
        os.kill(stopped, signal.SIGSTOP)
        results: list[Any] = [None] * UPLOADS

        def upload(index: int) -> None:
            try:
                results[index] = Controller(url=client.url).write_file(sandbox_id, f"/root/up{index}", _pieces(index))
            except Exception as exc:  # reported below
                results[index] = exc

        uploaders = [threading.Thread(target=upload, args=(i,), daemon=True) for i in range(UPLOADS)]
        for uploader in uploaders:
            uploader.start()
        pid, uploads = daemon.process.pid, home / "uploads"  # type: ignore[union-attr]
        wait_until(lambda: len(_spool(pid, uploads)) == SPOOL_FILES
                   and sum(_spool(pid, uploads)) >= (SPOOL_MIB - 4) * MIB, bound_s=120)
        held = [_spool(pid, uploads) for _ in range(20)]  # sampled while the senders push on
        print(f"\nspool files and bytes while the guest is stopped: {held[-1]}")
        bound = SPOOL_MIB * MIB + SPOOL_FILES * FS_SLACK
        assert all(len(files) <= SPOOL_FILES and sum(files) <= bound for files in held), held
        assert all(result is None for result in results)  # none finished: the guest writes nothing
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        for uploader in uploaders:
            uploader.join(600)
        assert [r if isinstance(r, Exception) else r["size"] for r in results] == [UPLOAD_MIB * MIB] * UPLOADS
        sizes = client.exec(sandbox_id, "stat -c %s /root/up*")["stdout"].split()
        assert sizes == [str(UPLOAD_MIB * MIB)] * UPLOADS
        assert _spool(pid, uploads) == []
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        daemon.stop()
