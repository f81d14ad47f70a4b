"""Walking snapshot chains in the registry: parents, digests, removal order, sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.store.chains import ChainBroken, ancestry, chain_memory, descendants, describe_chain, parent_digests
from forkd.store.registry import Registry, SnapshotRecord
from forkd.store.usage import directory_usage

DISK = "disk.layer"  # the backend's disk layer name: the store knows no other


def add(registry: Registry, tmp_path: Path, tag: str, parent: str | None, kind: str = "diff") -> SnapshotRecord:
    own = "memory.layer" if kind == "diff" else "memory"
    meta = {"memory_kind": kind, "sha256": {own: f"{tag}-mem", DISK: f"{tag}-disk"}}
    if parent is not None:
        meta["parent_sha256"] = parent_digests(registry.get_snapshot(parent), DISK)
    (tmp_path / tag).mkdir()
    (tmp_path / tag / own).write_bytes(b"x" * 5000)
    record = SnapshotRecord(tag, "ready", "default", tmp_path / tag, float(len(registry.list_snapshots())),
                            meta, parent_tag=parent)
    registry.add_snapshot(record)
    return record


@pytest.fixture
def chain(tmp_path: Path) -> Registry:
    registry = Registry(tmp_path / "state.db")
    add(registry, tmp_path, "root", None, kind="full")
    add(registry, tmp_path, "a", "root")
    add(registry, tmp_path, "b", "a")
    add(registry, tmp_path, "full", "b", kind="full")
    add(registry, tmp_path, "c", "full")
    add(registry, tmp_path, "side", "a")
    return registry


def test_chain_memory_starts_at_the_nearest_full_file(chain: Registry, tmp_path: Path) -> None:
    links = ancestry(chain, chain.get_snapshot("b"), DISK)
    assert [r.tag for r in links] == ["b", "a", "root"]
    memory = chain_memory(links)
    assert memory.base == tmp_path / "root" / "memory"
    assert memory.layers == (tmp_path / "a" / "memory.layer", tmp_path / "b" / "memory.layer")
    over_full = chain_memory(ancestry(chain, chain.get_snapshot("c"), DISK))
    assert over_full.base == tmp_path / "full" / "memory" and over_full.layers == (tmp_path / "c" / "memory.layer",)


def test_missing_or_replaced_parents_are_named(chain: Registry, tmp_path: Path) -> None:
    chain.remove_snapshot("a")
    with pytest.raises(ChainBroken, match="'b' needs its parent 'a', which is missing"):
        ancestry(chain, chain.get_snapshot("b"), DISK)
    chain.add_snapshot(SnapshotRecord("a", "ready", "default", tmp_path / "a", 9.0,
                                      {"memory_kind": "diff", "sha256": {"memory.layer": "other", DISK: "d"}},
                                      parent_tag="root"))
    with pytest.raises(ChainBroken, match="another 'a'"):
        ancestry(chain, chain.get_snapshot("b"), DISK)


def test_descendants_deepest_first_and_description(chain: Registry) -> None:
    order = descendants(chain, "a")
    assert set(order) == {"b", "full", "c", "side"}
    assert order.index("c") < order.index("full") < order.index("b")
    info = describe_chain(chain, chain.get_snapshot("c"))
    assert (info["depth"], info["ancestors"]) == (4, ["full", "b", "a", "root"])
    assert info["dependents"] == [] and 0 < info["own_bytes"] < info["chain_bytes"]
    assert info["disk"] == directory_usage(chain.get_snapshot("c").path)  # the listing's meaning, not another
    assert sorted(describe_chain(chain, chain.get_snapshot("a"))["dependents"]) == ["b", "side"]


def test_a_layer_that_names_itself_as_parent_ends_every_walk(tmp_path: Path) -> None:
    """Branching a sandbox whose head snapshot was removed, to that same tag, registered a layer whose
    parent is itself: listing it then walked its ancestors (and removing it its dependents) forever."""
    registry = Registry(tmp_path / "state.db")
    add(registry, tmp_path, "root", None, kind="full")
    (tmp_path / "loop").mkdir()
    registry.add_snapshot(SnapshotRecord("loop", "ready", "default", tmp_path / "loop", 1.0,
                                         {"memory_kind": "diff", "sha256": {"memory.layer": "m", DISK: "d"}},
                                         parent_tag="loop"))
    add(registry, tmp_path, "above", "loop")
    info = describe_chain(registry, registry.get_snapshot("above"))
    assert (info["depth"], info["ancestors"]) == (1, ["loop"])
    assert descendants(registry, "loop") == ["above"]
    with pytest.raises(ChainBroken, match="loops"):
        ancestry(registry, registry.get_snapshot("above"), DISK)
