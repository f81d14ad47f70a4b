"""Long jobs (packs, image builds, the doctor) run on a bounded pool of their own: any number of them
leaves the threads forks wait on free; a busy image lock is a 409 at once, never a thread waiting."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import short_tmp_dir
from forkd.config import Paths
from forkd.image.errors import ImageBusy
from forkd.image.store import image_lock, remove_image
from forkd.packs import archive
from forkd.vmm.fake import FakeVmm
from test_runtime_fake_vmm import _runtime, run

# asyncio's default executor (asyncio.to_thread) has this many threads; more long jobs than it holds.
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)
BOUND_S = 20.0  # a deadlock detector, not a measurement
pytestmark = pytest.mark.timeout(120)  # before the fix the image lock was waited for forever


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_tmp_dir("fkj-") as directory:
        yield directory


def test_many_long_packs_leave_forks_their_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release, entered = threading.Event(), []

    def slow_write_pack(*_args: Any, **_kwargs: Any) -> Any:
        entered.append(threading.current_thread().name)
        release.wait(60)
        raise OSError("the test stopped this pack")
    monkeypatch.setattr(archive, "write_pack", slow_write_pack)

    async def scenario() -> tuple[list[Any], list[Any], int]:
        runtime = await _runtime(tmp_path, FakeVmm())
        packs = [asyncio.create_task(runtime.packs.pack("base", tmp_path / f"p{i}.tar.zst", False, lambda _: None))
                 for i in range(DEFAULT_EXECUTOR_THREADS + 2)]
        try:
            while len(entered) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # any pack that could take another thread has taken it now
            running = len(entered)
            outcomes = await asyncio.wait_for(runtime.spawner.fork("base", 1), BOUND_S)
            answer = await asyncio.wait_for(runtime.sessions.ping(outcomes[0].sandbox["id"]), BOUND_S)
            return outcomes, [answer], running
        finally:
            release.set()
            await asyncio.gather(*packs, return_exceptions=True)
            await runtime.stop()

    outcomes, answers, running = run(scenario)
    assert [o.error for o in outcomes] == [None] and answers
    assert running == 2  # the long jobs' pool: the others queued
    assert {name.rsplit("_", 1)[0] for name in entered} == {"forkd-job"}


def test_a_busy_image_lock_is_a_409_at_once(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from forkd.daemon.app import create_app
    from store_helpers import make_runtime
    runtime = make_runtime(tmp_path)
    paths: Paths = runtime.paths
    (paths.images / "default").mkdir(parents=True)
    api = TestClient(create_app(runtime), raise_server_exceptions=False)
    answers: list[Any] = []
    with image_lock(paths, "default"):  # a build of it, here or in another process
        with pytest.raises(ImageBusy, match="retry when that is done"):
            remove_image(paths, "default")
        for _ in range(8):  # more than the store's threads: none of them waits on the lock
            caller = threading.Thread(target=lambda: answers.append(api.delete("/v1/images/default")), daemon=True)
            caller.start()
            caller.join(BOUND_S)
    assert [a.status_code for a in answers] == [409] * 8
    assert {a.json()["error"]["code"] for a in answers} == {"conflict"}
    assert (paths.images / "default").is_dir()
    assert api.delete("/v1/images/default").status_code == 200  # free again: removed
    assert not (paths.images / "default").exists()
