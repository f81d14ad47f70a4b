"""Placement over the directory (forkd.cluster.placement), without Ray or daemons: compatible nodes only,
holders first, replication to the next best nodes before a fan-out the holders cannot take, and errors
that name which nodes hold a snapshot."""

from __future__ import annotations

import pytest

from forkd.cluster.placement import Directory, NodeState, PlacementError, SnapshotCopy

D1, D2 = "1" * 64, "2" * 64


def node(name: str, slots: int, held: tuple[str, ...] = (), compat: str = "tcg", alive: bool = True) -> NodeState:
    return NodeState(ray_node_id=f"ray-{name}", node_id=name, url=f"http://{name}:7070", token="t",
                     compat_key=f"key-{compat}", compat={"accel": compat, "machine": "q35"}, slots_free=slots,
                     max_sandboxes=slots, live=0, snapshots=tuple(SnapshotCopy(tag="base", digest=d) for d in held),
                     alive=alive)


def directory(*states: NodeState) -> Directory:
    found = Directory()
    found.update(states)
    return found


def test_holders_with_room_need_no_replication() -> None:
    nodes = directory(node("a", 4, (D1,)), node("b", 4))
    assert nodes.replication_plan(D1, 4) == []


def test_a_fan_out_larger_than_the_holders_replicates_to_the_roomiest_compatible_nodes_first() -> None:
    nodes = directory(node("a", 4, (D1,)), node("b", 2), node("c", 8), node("d", 16, compat="kvm"))
    plan = nodes.replication_plan(D1, 10)
    assert [(p.target.node_id, p.source.node_id) for p in plan] == [("c", "a")]  # d is incompatible
    plan = nodes.replication_plan(D1, 13)
    assert [p.target.node_id for p in plan] == ["c", "b"]


def test_pulls_spread_over_the_holders() -> None:
    nodes = directory(node("a", 1, (D1,)), node("b", 1, (D1,)), node("c", 1), node("d", 1))
    assert [p.source.node_id for p in nodes.replication_plan(D1, 4)] == ["a", "b"]


def test_a_dead_node_neither_holds_nor_takes_work() -> None:
    nodes = directory(node("a", 4, (D1,)), node("b", 4, (D1,)), node("c", 4))
    nodes.mark_dead("ray-b")
    assert [s.node_id for s in nodes.holders(D1)] == ["a"]
    assert [p.target.node_id for p in nodes.replication_plan(D1, 8)] == ["c"]


def test_a_node_that_refused_a_fork_gets_no_more_than_it_runs() -> None:
    nodes = directory(node("a", 4, (D1,)), node("b", 4, (D1,)))
    nodes.limit_slots("ray-a", 1)
    assert [(s.node_id, s.slots_free) for s in nodes.holders(D1)] == [("b", 4), ("a", 1)]
    alone = directory(node("a", 4, (D1,)), node("c", 4))
    assert alone.replication_plan(D1, 4) == []
    alone.limit_slots("ray-a", 1)
    assert [p.target.node_id for p in alone.replication_plan(D1, 4)] == ["c"]  # so the items go elsewhere


def test_an_unknown_digest_names_the_nodes_asked() -> None:
    nodes = directory(node("a", 4, (D1,)), node("b", 4))
    with pytest.raises(PlacementError, match=r"held by none of the alive nodes \(a .*b ") as refused:
        nodes.resolve(D2)
    assert "pull or unpack it" in str(refused.value)


def test_a_digest_held_only_by_a_dead_node_says_so() -> None:
    nodes = directory(node("a", 4), node("b", 4, (D2,)))
    nodes.mark_dead("ray-b")
    with pytest.raises(PlacementError, match="held only by node.*that died: b"):
        nodes.resolve(D2)


def test_tags_resolve_to_one_digest_or_are_refused() -> None:
    assert directory(node("a", 1, (D1,)), node("b", 1, (D1,))).resolve("base") == D1
    with pytest.raises(PlacementError, match="different snapshots on different nodes"):
        directory(node("a", 1, (D1,)), node("b", 1, (D2,))).resolve("base")
    with pytest.raises(PlacementError, match="no alive node has a snapshot tagged 'other'"):
        directory(node("a", 1, (D1,))).resolve("other")



def test_a_node_without_a_sandbox_limit_counts_its_slots_by_free_memory() -> None:
    """``max_sandboxes`` unset: ``/v1/node`` answers null for it and for ``slots_free`` (the contract allows it)."""
    answer = {"node_id": "n", "compat_key": "k", "compat": {},
              "capacity": {"max_sandboxes": None, "slots_free": None, "live": 3, "mem_available_bytes": 10 << 30},
              "snapshots": []}
    state = NodeState.from_answers("ray-n", "http://n:7070", None, answer)
    assert (state.slots_free, state.max_sandboxes, state.live) == (160, 0, 3)
