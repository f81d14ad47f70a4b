"""The memory-layer format and diff: pages that differ from a chain's memory, and nothing else."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from array import array
from pathlib import Path

import pytest

from forkd.store.layers import (
    PAGE_SIZE,
    ChainMemory,
    LayerError,
    Pages,
    data_extents,
    drop_unchanged,
    flatten,
    punch_zero_pages,
    read_layer,
    write_layer,
)
from forkd.store.files import sha256_file

SIZE = 64 * PAGE_SIZE


def sparse(path: Path, pages: dict[int, bytes], size: int = SIZE) -> Path:
    """A sparse file of ``size`` bytes with the given pages written (the rest holes)."""
    with open(path, "wb") as f:
        f.truncate(size)
        for index, fill in pages.items():
            f.seek(index * PAGE_SIZE)
            f.write(fill * (PAGE_SIZE // len(fill)))
    return path


def pages_of(memory: Path, indices: list[int]) -> Pages:
    """What a BRANCH copies out of a VMM: these pages of its memory, in order."""
    data = memory.read_bytes()
    return Pages(offsets=array("Q", [i * PAGE_SIZE for i in indices]),
                 data=memoryview(b"".join(data[i * PAGE_SIZE:(i + 1) * PAGE_SIZE] for i in indices)))


def view(memory: ChainMemory) -> bytes:
    fds = [os.open(layer.path, os.O_RDONLY) for layer in memory.layers]
    base = os.open(memory.base, os.O_RDONLY)
    try:
        return memory.read(fds, base, 0, SIZE)
    finally:
        for fd in (*fds, base):
            os.close(fd)


def test_layer_round_trip_and_runs(tmp_path: Path) -> None:
    memory = sparse(tmp_path / "m", {1: b"a", 2: b"b", 7: b"c"})
    offsets = array("Q", [1 * PAGE_SIZE, 2 * PAGE_SIZE, 7 * PAGE_SIZE])
    pages = pages_of(memory, [1, 2, 7])
    assert [(o, n) for o, _, n in pages.runs()] == [(PAGE_SIZE, 2 * PAGE_SIZE), (7 * PAGE_SIZE, PAGE_SIZE)]
    written = write_layer(tmp_path / "l", pages)
    layer = read_layer(tmp_path / "l")
    assert list(layer.offsets) == list(offsets) and layer.page_size == PAGE_SIZE
    assert [(o, n) for o, _, n in layer.runs()] == [(PAGE_SIZE, 2 * PAGE_SIZE), (7 * PAGE_SIZE, PAGE_SIZE)]
    assert list(written.runs()) == list(layer.runs())
    assert written.sha256 == sha256_file(tmp_path / "l")  # hashed as it was written
    with open(tmp_path / "l", "rb") as f:
        _, position, _ = list(layer.runs())[1]
        f.seek(position)
        assert f.read(PAGE_SIZE) == b"c" * PAGE_SIZE


def test_truncated_or_foreign_layers_are_refused(tmp_path: Path) -> None:
    memory = sparse(tmp_path / "m", {3: b"x"})
    write_layer(tmp_path / "l", pages_of(memory, [3]))
    data = (tmp_path / "l").read_bytes()
    (tmp_path / "short").write_bytes(data[:-1])
    (tmp_path / "foreign").write_bytes(b"NOTLAYER" + data[8:])
    for name, reason in (("short", "truncated"), ("foreign", "not a forkd memory layer")):
        with pytest.raises(LayerError, match=reason):
            read_layer(tmp_path / name)


def test_diff_holds_changed_and_zeroed_pages_only(tmp_path: Path) -> None:
    base = sparse(tmp_path / "base", {0: b"k", 5: b"s", 9: b"z"})
    # The child changed page 5, wrote new page 20, zeroed page 9, rewrote page 0 with what it held.
    child = sparse(tmp_path / "child", {0: b"k", 5: b"S", 20: b"n"})
    kept = drop_unchanged(pages_of(child, [0, 5, 9, 20]), ChainMemory(base, []))
    assert list(kept.offsets) == [5 * PAGE_SIZE, 9 * PAGE_SIZE, 20 * PAGE_SIZE]
    layer = write_layer(tmp_path / "layer", kept)
    assert view(ChainMemory(base, [layer])) == (tmp_path / "child").read_bytes()


def test_layers_stack_base_first(tmp_path: Path) -> None:
    base = sparse(tmp_path / "base", {1: b"0", 2: b"0"})
    one = sparse(tmp_path / "one", {1: b"1", 2: b"0"})
    first = write_layer(tmp_path / "l1", drop_unchanged(pages_of(one, [1, 2]), ChainMemory(base, [])))
    assert list(first.offsets) == [1 * PAGE_SIZE]
    two = sparse(tmp_path / "two", {1: b"1", 2: b"2", 3: b"2"})
    # A child of the first layer holds its pages privately too (laid in at restore): they are dropped.
    second_pages = drop_unchanged(pages_of(two, [1, 2, 3]), ChainMemory(base, [first]))
    assert list(second_pages.offsets) == [2 * PAGE_SIZE, 3 * PAGE_SIZE]
    second = write_layer(tmp_path / "l2", second_pages)
    assert view(ChainMemory(base, [first, second])) == (tmp_path / "two").read_bytes()
    assert not list(drop_unchanged(pages_of(two, [1, 2, 3]), ChainMemory(base, [first, second])).offsets)


def test_flatten_writes_what_children_see_and_stays_sparse(tmp_path: Path) -> None:
    base = sparse(tmp_path / "base", {1: b"0", 30: b"0"})
    top = sparse(tmp_path / "top", {1: b"1", 30: b"0", 40: b"4"})
    layer = write_layer(tmp_path / "l", drop_unchanged(pages_of(top, [1, 30, 40]), ChainMemory(base, [])))
    flatten(ChainMemory(base, [layer]), tmp_path / "flat")
    assert (tmp_path / "flat").read_bytes() == top.read_bytes()
    assert os.stat(tmp_path / "flat").st_blocks * 512 < SIZE


def test_zero_pages_become_holes_again(tmp_path: Path) -> None:
    path = sparse(tmp_path / "m", {0: b"a", 1: b"\0", 2: b"\0", 3: b"b"})
    with open(path, "r+b") as f:  # a written zero MiB (what a VMM leaves on tmpfs)
        f.seek(16 * PAGE_SIZE)
        f.write(bytes(1 << 20))
    content = path.read_bytes()
    before = os.stat(path).st_blocks
    freed = punch_zero_pages(path)
    assert freed == 2 * PAGE_SIZE + (1 << 20)
    assert path.read_bytes() == content and os.stat(path).st_blocks < before
    assert punch_zero_pages(path) == 0


def _chain_with_holes(tmp_path: Path) -> tuple[ChainMemory, Pages, int]:
    """A base with data and holes over 4 chunks and a bit (the flattening unit is a MiB), two diff
    layers above it, and the pages a BRANCH of its child copied out: unchanged, changed, zeroed,
    new in holes, across a chunk boundary, in the last partial chunk, and zeroing a whole chunk."""
    mib = 1 << 20
    size = 4 * mib + 3 * PAGE_SIZE
    per_mib = mib // PAGE_SIZE

    def write(path: Path, pages: dict[int, bytes]) -> Path:
        return sparse(path, pages, size)

    base_pages = {0: b"b", 1: b"b", 2: b"b", per_mib - 1: b"e", 2 * per_mib + 7: b"c", 3 * per_mib: b"q"}
    base = write(tmp_path / "base", base_pages)
    one = write(tmp_path / "one", {**base_pages, 1: b"1", per_mib + 3: b"1"})
    first = write_layer(tmp_path / "l1", drop_unchanged(pages_of(one, [1, per_mib + 3]), ChainMemory(base, [])))
    two = write(tmp_path / "two", {**base_pages, 1: b"1", per_mib + 3: b"1", per_mib - 1: b"2", per_mib: b"2"})
    second = write_layer(tmp_path / "l2", drop_unchanged(pages_of(two, [per_mib - 1, per_mib]),
                                                          ChainMemory(base, [first])))
    chain = ChainMemory(base, [first, second])
    child = {**base_pages, 1: b"1", per_mib + 3: b"1", per_mib - 1: b"2", per_mib: b"2",  # the chain's, kept
             0: b"b",  # written with what it held
             2: b"\0",  # zeroed
             per_mib + 3: b"T", per_mib + 4: b"T",  # over a layer's page, and new in a hole
             2 * per_mib - 1: b"x", 2 * per_mib: b"x",  # a run across a chunk boundary
             3 * per_mib: b"\0",  # the only data of its chunk, zeroed
             4 * per_mib + 2: b"z"}  # in the last, partial chunk
    captured = [0, 1, 2, per_mib - 1, per_mib, per_mib + 3, per_mib + 4, 2 * per_mib - 1, 2 * per_mib,
                3 * per_mib, 4 * per_mib + 2]
    top = pages_of(write(tmp_path / "child", child), captured)
    return chain, top, size


def test_flattening_with_the_top_in_one_pass_matches_the_separate_layer_and_hashes_the_file(tmp_path: Path) -> None:
    chain, top, size = _chain_with_holes(tmp_path)
    expected = (tmp_path / "child").read_bytes()
    # The separate path: the top's changed pages as a layer over the chain, flattened, then hashed.
    changed = drop_unchanged(top, chain)
    layer = write_layer(tmp_path / "top-layer", changed)
    separate = flatten(ChainMemory(chain.base, [*chain.layers, layer]), tmp_path / "separate")
    fused = flatten(chain, tmp_path / "fused", top=top)
    assert (tmp_path / "fused").read_bytes() == (tmp_path / "separate").read_bytes() == expected
    assert fused.sha256 == separate.sha256 == sha256_file(tmp_path / "fused") == hashlib.sha256(expected).hexdigest()
    assert fused.changed_pages == len(changed.offsets) == 7
    # Holes stay holes: the chunk the top zeroed and the chunks nothing was written in hold no data.
    mib = 1 << 20
    extents = data_extents(tmp_path / "fused")
    assert not [e for e in extents if e[0] < 4 * mib and e[1] > 3 * mib]
    assert os.stat(tmp_path / "fused").st_blocks * 512 < size // 2


def test_a_page_beyond_the_memory_is_refused(tmp_path: Path) -> None:
    base = sparse(tmp_path / "base", {1: b"b"})
    beyond = Pages(offsets=array("Q", [SIZE]), data=memoryview(bytes(PAGE_SIZE)))
    with pytest.raises(LayerError, match="beyond"):
        flatten(ChainMemory(base, []), tmp_path / "flat", top=beyond)


def test_a_layer_written_against_its_parent_keeps_the_changed_pages_without_copying_them(tmp_path: Path) -> None:
    """A BRANCH's diff layer: the pages equal to the parent's are dropped as it is written, the others
    go from the captured buffer to the file through small reused buffers, never copied as a whole
    (a 64 MiB layer used to cost a second 64 MiB in the daemon); the file and digest are the same."""
    count = 4096  # 16 MiB of pages, in runs of 16 with a gap after each
    indices = [run * 17 + i for run in range(count // 16) for i in range(16)]
    size = (indices[-1] + 1) * PAGE_SIZE
    base = sparse(tmp_path / "base", {indices[5]: b"same", indices[700]: b"also"}, size)
    data = bytearray(os.urandom(count * PAGE_SIZE))
    for unchanged in (5, 700):  # two captured pages the child did not change after all
        data[unchanged * PAGE_SIZE:(unchanged + 1) * PAGE_SIZE] = (b"same" if unchanged == 5 else b"also") * 1024
    pages = Pages(offsets=array("Q", [i * PAGE_SIZE for i in indices]), data=memoryview(data))
    parent = ChainMemory(base, [])
    expected = write_layer(tmp_path / "copied", drop_unchanged(pages, parent))
    tracemalloc.start()
    try:
        layer = write_layer(tmp_path / "layer", pages, parent)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak  # a few 1 MiB buffers in flight and the page index, not the 16 MiB
    assert list(layer.offsets) == [i * PAGE_SIZE for n, i in enumerate(indices) if n not in (5, 700)]
    assert (tmp_path / "layer").read_bytes() == (tmp_path / "copied").read_bytes()
    assert layer.sha256 == expected.sha256 == sha256_file(tmp_path / "layer")
    assert list(read_layer(tmp_path / "layer").offsets) == list(layer.offsets)
