"""The snapshot store against real SQLite and real files: one claim per tag, publishing that never
overwrites, the one reaper, and the races the store exists to settle (no VM is started)."""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from store_helpers import make_runtime, make_snapshot, pack_of, unpack
from test_runtime_fake_vmm import _image as fake_image
from test_runtime_fake_vmm import _runtime as fake_runtime
from test_runtime_fake_vmm import run as fake_run

import forkd.store
from forkd.runtime.runtime import Runtime
from forkd.runtime.snapshots import SnapshotRequest
from forkd.store.errors import SnapshotConflict
from forkd.store.files import DigestCache, sha256_file
from forkd.store.registry import SnapshotRecord
from forkd.vmm.fake import FakeVmm

TAG = "contested"


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    return make_runtime(tmp_path / "a")


def _build(runtime: Runtime, tag: str, content: bytes) -> tuple[Path, SnapshotRecord]:
    """A small finished build directory for ``tag`` as a builder leaves it, and its record."""
    build_dir = runtime.store.build_dir(tag)
    (build_dir / "state").write_bytes(content)
    meta = runtime.store.write_meta(build_dir, {"sha256": runtime.store.seal(build_dir, ["state"])})
    return build_dir, SnapshotRecord(tag=tag, status="ready", image="default", path=runtime.paths.snapshots / tag,
                                     created_at=1.0, meta=meta)


async def _until_held(runtime: Runtime, tag: str, task: asyncio.Task[object]) -> None:
    for _ in range(1000):  # at most ~10 s
        if runtime.store.held_for(tag) or task.done():
            return
        await asyncio.sleep(0.01)


def _no_work_left(runtime: Runtime) -> bool:
    return not [p for p in runtime.paths.snapshots.iterdir() if p.name.startswith(".")]


def test_claims_of_one_tag_from_many_threads_at_once_let_exactly_one_win(runtime: Runtime) -> None:
    barrier = threading.Barrier(8)
    won, refused = [], []

    def contend(purpose: str) -> None:
        barrier.wait(timeout=10)
        try:
            won.append(runtime.store.claim(TAG, purpose))
        except SnapshotConflict as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=contend, args=(f"purpose-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(won) == 1 and len(refused) == 7
    assert all(f"is being {won[0].purpose} by another request" in message for message in refused)
    won[0].release()
    runtime.store.claim(TAG, "created").release()  # free again once released


def test_a_registered_tag_cannot_be_claimed_and_a_claimed_one_cannot_be_opened(runtime: Runtime) -> None:
    make_snapshot(runtime, "base")
    with pytest.raises(SnapshotConflict, match="exists"):
        runtime.store.claim("base", "created")
    with runtime.store.claim(TAG, "compacted"):
        with pytest.raises(SnapshotConflict, match="still being compacted"):
            runtime.store.open(TAG)
        with pytest.raises(SnapshotConflict, match="being compacted"):
            runtime.store.claim([TAG, "other"], "unpacked", existing_ok=True)
        runtime.store.claim("other", "created").release()  # all or none: "other" was not kept


def test_publish_never_replaces_what_sits_at_the_destination(runtime: Runtime) -> None:
    squatter = runtime.paths.snapshots / TAG
    squatter.mkdir()
    (squatter / "precious").write_bytes(b"not forkd's to delete")
    with runtime.store.claim(TAG, "created") as claim:
        build_dir, record = _build(runtime, TAG, b"new")
        with pytest.raises(SnapshotConflict, match="exists but is no registered snapshot"):
            runtime.store.publish(claim, [(build_dir, record)])
    assert (squatter / "precious").read_bytes() == b"not forkd's to delete"
    assert (build_dir / "state").read_bytes() == b"new"  # put back where it was; its builder removes it
    assert runtime.registry.get_snapshot(TAG) is None


def test_publishing_without_holding_the_tag_is_refused(runtime: Runtime) -> None:
    build_dir, record = _build(runtime, TAG, b"x")
    with runtime.store.claim("other", "created") as claim, pytest.raises(Exception, match="without holding its tag"):
        runtime.store.publish(claim, [(build_dir, record)])
    assert not (runtime.paths.snapshots / TAG).exists()


def test_the_reaper_fails_writing_records_and_removes_what_no_record_names(runtime: Runtime) -> None:
    make_snapshot(runtime, "kept")
    runtime.registry.add_snapshot(SnapshotRecord("halfway", "writing", "default", runtime.paths.snapshots / "halfway",
                                                 1.0, {"mode": "diff"}, parent_tag="kept"))
    (runtime.paths.snapshots / ".build-halfway-0a0b0c0d").mkdir()
    (runtime.paths.snapshots / ".unpack-0a0b0c0d0e0f").mkdir()  # left by a daemon from before the store
    (runtime.paths.snapshots / "unregistered").mkdir()
    (runtime.paths.snapshots / "lost+found").mkdir()
    assert runtime.store.reap() == [".build-halfway-0a0b0c0d", ".unpack-0a0b0c0d0e0f", "unregistered"]
    halfway = runtime.registry.get_snapshot("halfway")
    assert halfway is not None and (halfway.status, halfway.error) == ("failed", "the daemon stopped while writing it")
    assert sorted(p.name for p in runtime.paths.snapshots.iterdir()) == ["kept", "lost+found"]


# The race the store settles: every way a snapshot comes to exist, for one tag, at once. One contender
# (compact or unpack, which need no VM) takes the tag and builds for real; while it does, all the others
# ask for the same tag, each through its own entry point as the daemon calls it. Those that would need
# a VM to get further (create, BRANCH, snapshot-diff) are refused before they touch one. (Claims made
# at the same instant from many threads are the first test above.)

Contender = Callable[[Runtime, Path], Awaitable[object]]


async def _create(runtime: Runtime, _: Path) -> object:
    return runtime.snapshots.claim(TAG)  # what POST /v1/snapshots does before it streams the bake


async def _branch(runtime: Runtime, _: Path) -> object:
    return await runtime.branches.branch("sb-000000000000", TAG, "diff")


async def _diff(runtime: Runtime, _: Path) -> object:
    return await runtime.branches.diff_exec("base", TAG, "true", 10)


async def _compact(runtime: Runtime, _: Path) -> object:
    return await runtime.compaction.compact("base", TAG)


async def _unpack(runtime: Runtime, pack: Path) -> object:
    return await runtime.packs.unpack(pack, TAG, False, lambda _: None)


LOSERS: dict[str, Contender] = {"create": _create, "branch": _branch, "diff": _diff}
WINNERS: dict[str, Contender] = {"compact": _compact, "unpack": _unpack}


@pytest.mark.parametrize("winner", sorted(WINNERS))
def test_create_branch_compact_diff_and_unpack_of_one_tag_at_once(winner: str, runtime: Runtime,
                                                                   tmp_path: Path) -> None:
    base = make_snapshot(runtime, "base")
    other = make_runtime(tmp_path / "b")
    make_snapshot(other, "source")
    pack = tmp_path / "source.tar.zst"
    pack_of(other, "source", pack)
    base_digests = {name: sha256_file(base.path / name) for name in base.meta["sha256"]}
    others = {**LOSERS, **{k: v for k, v in WINNERS.items() if k != winner}}

    async def race() -> dict[str, object]:
        first = asyncio.create_task(WINNERS[winner](runtime, pack))
        await _until_held(runtime, TAG, first)  # an unpack reads its manifest before it claims
        rest = await asyncio.gather(*(run(runtime, pack) for run in others.values()), return_exceptions=True)
        return {winner: (await asyncio.gather(first, return_exceptions=True))[0], **dict(zip(others, rest))}

    outcomes = asyncio.run(race())

    won = {name: result for name, result in outcomes.items() if not isinstance(result, BaseException)}
    assert list(won) == [winner]
    for name, result in outcomes.items():
        if name != winner:
            assert isinstance(result, SnapshotConflict), (name, result)
            assert f"snapshot {TAG!r} is being" in str(result), (name, result)
    record = runtime.store.get(TAG)
    expected = pack if winner == "unpack" else None
    if expected is not None:  # the unpacked files, byte for byte, not another contender's
        assert record.meta["sha256"] == other.registry.get_snapshot("source").meta["sha256"]
    else:
        assert record.meta["compacted_from"] == "base"
    runtime.store.open(TAG)  # every file is there and is the one its record names
    assert {name: sha256_file(base.path / name) for name in base.meta["sha256"]} == base_digests
    assert sorted(r.tag for r in runtime.registry.list_snapshots()) == ["base", TAG]
    assert _no_work_left(runtime)


def test_tags_an_unpack_holds_cannot_be_removed_or_taken_until_it_is_done(runtime: Runtime, tmp_path: Path) -> None:
    make_snapshot(runtime, "base")
    make_snapshot(runtime, "layer", parent="base")
    base_pack, layer_pack = tmp_path / "base.tar.zst", tmp_path / "layer.tar.zst"
    pack_of(runtime, "base", base_pack)
    pack_of(runtime, "layer", layer_pack)
    clean = make_runtime(tmp_path / "b")
    unpack(clean, base_pack)

    async def race() -> list[object]:
        unpacking = asyncio.create_task(clean.packs.unpack(layer_pack, None, False, lambda _: None))
        await _until_held(clean, "layer", unpacking)  # and "base", which it reuses
        attempts = await asyncio.gather(clean.store.remove("base", lambda _: 0), clean.compaction.compact("base", "layer"),
                                        return_exceptions=True)
        return [await unpacking, *attempts]

    result, removing, compacting = asyncio.run(race())
    assert result["unpacked"] == ["layer"] and result["reused"] == ["base"]
    assert isinstance(removing, SnapshotConflict) and "'base' (being unpacked)" in str(removing)
    assert isinstance(compacting, SnapshotConflict) and "being unpacked" in str(compacting)
    assert clean.store.get("layer").parent_tag == "base"
    clean.store.open("layer")
    assert _no_work_left(clean)


def test_an_unpacked_chain_keeps_its_parent_link_so_its_base_is_not_removed_under_it(runtime: Runtime,
                                                                                      tmp_path: Path) -> None:
    make_snapshot(runtime, "base")
    make_snapshot(runtime, "layer", parent="base")
    pack = tmp_path / "layer.tar.zst"
    pack_of(runtime, "layer", pack)
    clean = make_runtime(tmp_path / "b")
    unpack(clean, pack)
    assert clean.registry.snapshot_children("base") == ["layer"]
    with pytest.raises(SnapshotConflict, match="has dependents layer"):
        asyncio.run(clean.store.remove("base", lambda _: 0))
    assert (clean.paths.snapshots / "base" / "memory").exists()
    # A file of an ancestor changed in the store is noticed when the chain is used.
    base_memory = clean.paths.snapshots / "base" / "memory"
    os.chmod(base_memory, 0o600)
    with open(base_memory, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"tampered")
    with pytest.raises(Exception, match="base.*memory was modified"):
        clean.store.open("layer")
    assert asyncio.run(clean.store.remove("base", lambda _: 0, cascade=True)) == ["layer", "base"]
    assert _no_work_left(clean) and sorted(p.name for p in clean.paths.snapshots.iterdir()) == []


# The same race with every contender able to win: on the FakeVmm (real registry, files, processes and
# guest protocol, no VM) create bakes and BRANCH captures for real too. Whichever starts first wins.

FAKE_CONTENDERS = ("create", "branch", "diff", "compact")


@pytest.mark.parametrize("winner", FAKE_CONTENDERS)
def test_each_way_to_make_a_snapshot_wins_alone_against_all_the_others(winner: str) -> None:
    home = Path(tempfile.mkdtemp(prefix="fks-", dir="/tmp"))  # short: agent socket paths are bounded

    async def scenario() -> tuple[dict[str, object], str, dict[str, object]]:
        vmm = FakeVmm()
        runtime = await fake_runtime(home, vmm)
        try:
            [outcome] = await runtime.spawner.fork("base", 1)
            source = outcome.sandbox["id"]
            ways = {
                "create": lambda: runtime.snapshots.create(SnapshotRequest(tag=TAG, memory_mib=1), fake_image(home),
                                                           lambda _: None),
                "branch": lambda: runtime.branches.branch(source, TAG, "diff"),
                "diff": lambda: runtime.branches.diff_exec("base", TAG, "true", 10),
                "compact": lambda: runtime.compaction.compact("base", TAG),
            }
            order = [winner, *(w for w in FAKE_CONTENDERS if w != winner)]
            results = await asyncio.gather(*(ways[w]() for w in order), return_exceptions=True)
            [child] = await runtime.spawner.fork(TAG, 1)  # the winner's snapshot is whole and forks
            return dict(zip(order, results)), child.error or "", runtime.store.get(TAG).meta
        finally:
            await runtime.stop()

    try:
        outcomes, fork_error, meta = fake_run(scenario)
        assert [w for w, r in outcomes.items() if not isinstance(r, BaseException)] == [winner]
        for name, result in outcomes.items():
            if name != winner:
                assert isinstance(result, SnapshotConflict) and f"snapshot {TAG!r} is being" in str(result), result
        assert fork_error == ""
        made_by = {"compact": "compacted_from" in meta, "create": "image_key" in meta and "mode" not in meta,
                   "branch": meta.get("mode") == "diff", "diff": meta.get("mode") == "diff"}
        assert made_by[winner]
        assert not [p for p in (home / "home" / "snapshots").iterdir() if p.name.startswith(".")]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_file_changed_behind_a_restored_mtime_is_hashed_again(tmp_path: Path) -> None:
    """Digests are cached per file version; putting the mtime back after a write does not fool it."""
    cache = DigestCache()
    path = tmp_path / "memory"
    path.write_bytes(b"a" * 4096)
    first = cache.sha256(path)
    before = path.stat()
    with open(path, "r+b") as f:
        f.write(b"b")  # same size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime as it was
    assert path.stat().st_mtime_ns == before.st_mtime_ns and path.stat().st_size == before.st_size
    assert cache.sha256(path) == sha256_file(path) != first


def test_the_store_imports_only_what_its_room_allows() -> None:
    """store/ sits below runtime/ and daemon/ (docs/architecture.md): it may use validation, the VMM's data
    types and disk format seam and the agent version, nothing above it."""
    allowed = ("forkd.store", "forkd.validation", "forkd.vmm.base", "forkd.vmm.disk", "forkd.guest.protocol")
    store = Path(forkd.store.__file__).parent
    imported = set()
    for module in store.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("forkd"):
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name.startswith("forkd"))
    assert imported and not [m for m in imported if not m.startswith(allowed)]
