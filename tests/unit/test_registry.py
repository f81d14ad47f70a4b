import sqlite3
from pathlib import Path

import pytest

from forkd.runtime.registry import Registry, SandboxRecord, SnapshotRecord


def test_snapshots_persist_across_reopen(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state.db")
    registry.add_snapshot(SnapshotRecord("base", "ready", "default", tmp_path / "base", 1.0, {"sha256": {"m": "ab"}}))
    registry.close()
    reopened = Registry(tmp_path / "state.db")
    record = reopened.get_snapshot("base")
    assert record is not None and record.meta == {"sha256": {"m": "ab"}} and record.path == tmp_path / "base"
    assert [r.tag for r in reopened.list_snapshots()] == ["base"]
    reopened.remove_snapshot("base")
    assert reopened.get_snapshot("base") is None


def test_duplicate_tags_are_refused(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state.db")
    record = SnapshotRecord("base", "ready", "default", tmp_path, 1.0)
    registry.add_snapshot(record)
    with pytest.raises(sqlite3.IntegrityError):
        registry.add_snapshot(record)


def test_sandbox_updates_merge_meta(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state.db")
    registry.add_sandbox(SandboxRecord("sb-aaaaaaaaaaaa", "base", "starting", None, tmp_path, 2.0, {"hostname": "h"}))
    registry.update_sandbox("sb-aaaaaaaaaaaa", status="running", pid=42, meta={"seconds_to_answer": 0.5})
    record = registry.get_sandbox("sb-aaaaaaaaaaaa")
    assert record is not None
    assert (record.status, record.pid, record.meta) == ("running", 42, {"hostname": "h", "seconds_to_answer": 0.5})
    registry.update_sandbox("sb-missing00000", status="running")  # a vanished record is not an error
    registry.remove_sandbox("sb-aaaaaaaaaaaa")
    assert registry.list_sandboxes() == []


def test_an_older_database_gains_the_readoption_columns(tmp_path: Path) -> None:
    db_path = tmp_path / "state.db"
    old = sqlite3.connect(db_path)
    old.executescript("""
        CREATE TABLE sandboxes (id TEXT PRIMARY KEY, snapshot_tag TEXT NOT NULL, status TEXT NOT NULL, pid INTEGER,
                                run_dir TEXT NOT NULL, created_at REAL NOT NULL, meta TEXT NOT NULL);
        INSERT INTO sandboxes VALUES ('sb-oldoldoldold', 'base', 'running', 7, '/x', 1.0, '{}');
    """)
    old.commit()
    old.close()
    registry = Registry(db_path)
    (record,) = registry.list_sandboxes()
    assert (record.id, record.pid, record.vmm_started, record.agent_socket) == ("sb-oldoldoldold", 7, None, None)
    registry.set_vmm("sb-oldoldoldold", 8, 12345, tmp_path / "a.sock", tmp_path / "q.sock")
    record = registry.get_sandbox("sb-oldoldoldold")
    assert record is not None
    assert (record.pid, record.vmm_started, record.agent_socket, record.monitor_socket) == (
        8, 12345, tmp_path / "a.sock", tmp_path / "q.sock")
    registry.close()
    Registry(db_path).close()  # opening an upgraded database again changes nothing


def test_replace_snapshots_is_all_or_nothing(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state.db")
    registry.add_snapshot(SnapshotRecord("old", "ready", "default", tmp_path / "old", 1.0))
    registry.add_snapshot(SnapshotRecord("other", "ready", "default", tmp_path / "other", 1.0))
    clash = [SnapshotRecord("new", "ready", "default", tmp_path, 2.0), SnapshotRecord("other", "ready", "d", tmp_path, 2.0)]
    with pytest.raises(sqlite3.IntegrityError):
        registry.replace_snapshots(clash, remove=("old",))
    assert [r.tag for r in registry.list_snapshots()] == ["old", "other"]
    registry.replace_snapshots([SnapshotRecord("old", "ready", "default", tmp_path / "new", 3.0)], remove=("old",))
    record = registry.get_snapshot("old")
    assert record is not None and record.path == tmp_path / "new"


def test_address_leases_are_unique_under_concurrency_and_persist(tmp_path: Path) -> None:
    import threading

    from forkd.runtime.registry import LeasesExhausted

    registry = Registry(tmp_path / "state.db")
    slots: list[int] = []
    threads = [threading.Thread(target=lambda i=i: slots.append(registry.lease_slot(f"sb-{i}", "p", 64)))
               for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(slots) == list(range(40))
    holder = next(sandbox for sandbox, (_, slot) in registry.leases().items() if slot == 7)
    registry.release_slot(holder)
    assert registry.lease_slot("sb-new", "p", 64, taken={7, 40}) == 41  # 7 is free here but taken on the host
    registry.close()
    reopened = Registry(tmp_path / "state.db")
    assert reopened.leases()["sb-new"] == ("p", 41) and holder not in reopened.leases()
    assert reopened.lease_slot("sb-again", "p", 64) == 7
    with pytest.raises(LeasesExhausted):
        reopened.lease_slot("sb-full", "small", 0)
