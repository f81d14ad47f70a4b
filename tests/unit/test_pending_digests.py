"""A full BRANCH publishes before its memory file is hashed (store/pending.py): the digest goes from
``pending`` to set, every consumer that needs it waits, a restarted daemon computes it again, removal
while it is pending is safe, and a file changed before it was hashed never gets a digest. Real SQLite,
real files, the fake VMM; the hash is held back through the ``hash_file`` seam."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
from array import array
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import run_bounded, short_tmp_dir
from test_runtime_fake_vmm import _written_source

from forkd.runtime.runtime import Runtime
from forkd.store import layers as memory_layers
from forkd.store.chains import layer_digest, record_digest
from forkd.store.errors import SnapshotCorrupt
from forkd.store.files import DigestCache, sha256_file
from forkd.store.layers import (
    PAGE_SIZE,
    ChainMemory,
    data_extents,
    flatten,
    write_layer,
)
from forkd.store.pending import (
    PENDING,
    DigestPending,
    PendingDigests,
    pending_files,
    sha256_sparse,
)
from forkd.store.registry import SnapshotRecord
from forkd.vmm.base import Pages

T = TypeVar("T")


def run(make: Callable[[], Awaitable[T]]) -> T:
    return run_bounded(make, 120)  # type: ignore[no-any-return]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_tmp_dir("fkp-") as directory:
        yield directory


class Gate:
    """Holds every hash of the store's pending digests until opened."""

    def __init__(self, runtime: Runtime) -> None:
        self.open = threading.Event()
        self.started = threading.Event()
        runtime.store.pending._hash = self._hash

    def _hash(self, path: Path) -> str:
        self.started.set()
        assert self.open.wait(60), "the test never opened the gate"
        return sha256_file(path)


def _real_digest(record: SnapshotRecord) -> str:
    """The layer digest ``record`` must end up with: every file hashed now, by this test."""
    return layer_digest({name: sha256_file(record.path / name) for name in record.meta["sha256"]})


async def _idle(runtime: Runtime) -> None:
    for _ in range(600):
        if not runtime.store.pending.busy():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"digests still pending: {runtime.store.pending.busy()}")


def test_a_full_branch_answers_before_its_memory_is_hashed_and_digest_consumers_wait(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime, source = await _written_source(tmp_path, 5 * PAGE_SIZE)
        try:
            gate = Gate(runtime)
            record = await runtime.branches.branch(source.record.id, "f1", mode="full")  # the hash is held
            assert record.meta["sha256"]["memory"] == PENDING and pending_files(record.meta) == ["memory"]
            assert json.loads((record.path / "meta.json").read_text())["sha256"]["memory"] == PENDING
            with pytest.raises(DigestPending):  # never a digest made of "pending"
                record_digest(record)
            runtime.store.open("f1")  # a fork does not wait: the file is as it was published
            expected = _real_digest(record)
            lookup = asyncio.ensure_future(asyncio.to_thread(runtime.store.by_digest, expected))
            listing = asyncio.ensure_future(runtime.node.describe())
            later = asyncio.ensure_future(runtime.branches.branch(source.record.id, "d2", mode="diff"))
            assert await asyncio.to_thread(gate.started.wait, 30)
            await asyncio.sleep(0.5)  # the consumers had time to finish, were they not waiting for the digest
            assert not lookup.done() and not listing.done() and not later.done()
            gate.open.set()
            found = await lookup
            assert found is not None and found.tag == "f1" and record_digest(found) == expected
            listed = {s["tag"]: s["digest"] for s in (await listing)["snapshots"]}
            assert listed["f1"] == expected
            child = await later  # a diff against it records its parent's real digests
            assert child.meta["parent_sha256"]["memory"] == found.meta["sha256"]["memory"] != PENDING
            on_disk = json.loads((record.path / "meta.json").read_text())
            assert on_disk == found.meta  # meta.json and the record agree
        finally:
            await runtime.stop()

    run(scenario)


def test_a_digest_left_pending_by_a_stopped_daemon_is_computed_again_at_start(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime, source = await _written_source(tmp_path, 5 * PAGE_SIZE)
        try:
            record = await runtime.branches.branch(source.record.id, "f1", mode="full")
            await _idle(runtime)
            expected = _real_digest(record)
            # What a daemon stopped mid-hash leaves: the record pending, and nothing in memory about it.
            runtime.registry._execute("UPDATE snapshots SET meta = ? WHERE tag = ?",
                                      (json.dumps(record.meta), "f1"))
            runtime.store.pending = PendingDigests(runtime.registry, DigestCache())
            assert pending_files(runtime.store.get("f1").meta) == ["memory"]
            await asyncio.to_thread(runtime.store.reap)  # at start
            assert runtime.store.pending.busy() == ["f1"] or not pending_files(runtime.store.get("f1").meta)
            settled = await runtime.store.pending.settled("f1")
            assert settled is not None and record_digest(settled) == expected
            # And a consumer asking before anything resumed it starts it itself.
            runtime.registry._execute("UPDATE snapshots SET meta = ? WHERE tag = ?",
                                      (json.dumps(record.meta), "f1"))
            runtime.store.pending = PendingDigests(runtime.registry, DigestCache())
            found = await asyncio.to_thread(runtime.store.by_digest, expected)
            assert found is not None and found.tag == "f1"
        finally:
            await runtime.stop()

    run(scenario)


def test_removing_a_snapshot_while_its_digest_is_pending_is_safe(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime, source = await _written_source(tmp_path, 5 * PAGE_SIZE)
        try:
            gate = Gate(runtime)
            first = await runtime.branches.branch(source.record.id, "f1", mode="full")
            assert await asyncio.to_thread(gate.started.wait, 10)
            waiter = asyncio.ensure_future(runtime.store.pending.settled("f1"))
            assert await runtime.store.remove("f1", lambda _tag: 0) == ["f1"]
            # The same tag made again (of another child: this one's head was removed) while the first
            # hash is still held: the first must not land on it.
            [other] = await runtime.spawner.fork("base", 1)
            second = await runtime.branches.branch(other.sandbox["id"], "f1", mode="full")
            assert second.created_at != first.created_at
            gate.open.set()
            assert await waiter is None or (await waiter).created_at == second.created_at
            await _idle(runtime)
            now = runtime.store.get("f1")
            assert now.status == "ready" and now.created_at == second.created_at
            assert record_digest(now) == _real_digest(now)
        finally:
            await runtime.stop()

    run(scenario)


def test_a_file_changed_before_it_was_hashed_never_gets_a_digest(tmp_path: Path) -> None:
    async def scenario() -> None:
        runtime, source = await _written_source(tmp_path, 5 * PAGE_SIZE)
        try:
            gate = Gate(runtime)
            record = await runtime.branches.branch(source.record.id, "f1", mode="full")
            memory = record.path / "memory"
            os.chmod(memory, 0o600)
            with open(memory, "r+b") as f:
                f.write(b"tampered")
            with pytest.raises(SnapshotCorrupt):  # a fork no longer trusts it, and the hash refuses it
                await asyncio.gather(asyncio.to_thread(runtime.store.open, "f1"),
                                     asyncio.to_thread(gate.open.set))
            await _idle(runtime)
            now = runtime.store.get("f1")
            assert now.status == "failed" and "modified" in (now.error or "")
            assert now.meta["sha256"]["memory"] == PENDING  # not the tampered file's digest
            # It never gets a digest, and does not break the consumers that list digests.
            listed = [entry["tag"] for entry in (await runtime.node.describe())["snapshots"]]
            assert "base" in listed and "f1" not in listed
            assert await asyncio.to_thread(runtime.store.by_digest, "0" * 64) is None
        finally:
            await runtime.stop()

    run(scenario)


@pytest.mark.parametrize("layout", ["holes-around", "data-at-both-ends", "all-hole", "empty"])
def test_the_background_hash_of_a_sparse_file_is_its_plain_sha256(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "memory"
    with open(path, "wb") as f:
        if layout != "empty":
            f.truncate((9 << 20) + 4097)  # not a whole number of chunks or pages
        if layout == "holes-around":
            f.seek(5 << 20)
            f.write(os.urandom(3 * 4096 + 17))
        if layout == "data-at-both-ends":
            f.write(os.urandom(4096))
            f.seek((9 << 20) + 1)
            f.write(os.urandom(4096))
    assert sha256_sparse(path) == sha256_file(path)


def test_a_memory_file_flattened_without_its_digest_is_the_same_file(tmp_path: Path) -> None:
    """``flatten(digest=False)`` (a BRANCH's) skips zeroing and hashing: the same bytes, holes and count."""
    rng = random.Random(7)
    base = tmp_path / "base"
    with open(base, "wb") as f:
        f.truncate(24 << 20)
        for at in (0, 3 << 20, (7 << 20) + 8192, 20 << 20):
            f.seek(at)
            f.write(rng.randbytes(rng.randrange(1, 600) * PAGE_SIZE))
    layer_pages = Pages(offsets=array("Q", sorted(rng.sample(range(0, 24 << 20, PAGE_SIZE), 300))),
                        data=memoryview(bytearray(rng.randbytes(300 * PAGE_SIZE))))
    layer = write_layer(tmp_path / "layer", layer_pages)
    chain = ChainMemory(base, [layer])
    top_offsets = sorted(rng.sample(range(0, 24 << 20, PAGE_SIZE), 900))
    data = bytearray(rng.randbytes(900 * PAGE_SIZE))
    for i in range(0, 900, 7):  # some zero pages, some equal to what lies below
        data[i * PAGE_SIZE:(i + 1) * PAGE_SIZE] = bytes(PAGE_SIZE)
    top = Pages(offsets=array("Q", top_offsets), data=memoryview(data))
    hashed = flatten(chain, tmp_path / "hashed", top=top)
    plain = flatten(chain, tmp_path / "plain", top=top, digest=False)
    assert plain.sha256 == "" and plain.changed_pages == hashed.changed_pages
    assert (tmp_path / "plain").read_bytes() == (tmp_path / "hashed").read_bytes()
    assert sha256_file(tmp_path / "plain") == hashed.sha256
    assert data_extents(tmp_path / "plain") == data_extents(tmp_path / "hashed")


def test_a_full_branch_does_not_hash_its_memory_while_it_writes_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller waits for the write only: the digest is computed after publishing, never twice."""
    asked: list[bool] = []
    real = memory_layers.flatten

    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("digest", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(memory_layers, "flatten", spy)

    async def scenario() -> None:
        runtime, source = await _written_source(tmp_path, 5 * PAGE_SIZE)
        try:
            await runtime.branches.branch(source.record.id, "f1", mode="full")
            await _idle(runtime)
        finally:
            await runtime.stop()

    run(scenario)
    assert asked == [False]
