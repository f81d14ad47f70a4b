import sqlite3
import threading
from pathlib import Path

import pytest

from forkd.store.registry import Registry, SandboxRecord, SnapshotRecord
from forkd.store.schema import MIGRATIONS, SCHEMA_VERSION, SchemaTooNew, migrate, schema_version


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


def test_what_changes_while_a_sandbox_runs_lives_outside_its_meta(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state.db")
    registry.add_sandbox(SandboxRecord("sb-aaaaaaaaaaaa", "base", "running", 42, tmp_path, 2.0, {"hostname": "h"},
                                       end_at=10.0))
    registry.set_end_at("sb-aaaaaaaaaaaa", 20.0)
    registry.publish_snapshots([SnapshotRecord("base-b1", "ready", "default", tmp_path, 3.0)],
                               head_of=("sb-aaaaaaaaaaaa", "base-b1"))  # the head moves with the publish
    registry.set_readopted("sb-aaaaaaaaaaaa", 30.0)
    record = registry.get_sandbox("sb-aaaaaaaaaaaa")
    assert record is not None and record.meta == {"hostname": "h"}
    assert (record.end_at, record.branch_head, record.head, record.readopted_at) == (20.0, "base-b1", "base-b1", 30.0)
    assert record.to_dict()["end_at"] == 20.0 and record.to_dict()["readopted_at"] == 30.0
    registry.set_end_at("sb-missing00000", 1.0)  # a vanished record is not an error
    registry.remove_sandbox("sb-aaaaaaaaaaaa")
    assert registry.list_sandboxes() == []


def test_a_publish_that_fails_leaves_the_sandbox_head_where_it_was(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state.db")
    registry.add_sandbox(SandboxRecord("sb-aaaaaaaaaaaa", "base", "running", 42, tmp_path, 2.0, {}))
    registry.add_snapshot(SnapshotRecord("b1", "ready", "default", tmp_path, 1.0))  # taken otherwise
    with pytest.raises(sqlite3.IntegrityError):
        registry.publish_snapshots([SnapshotRecord("b1", "ready", "default", tmp_path, 3.0)],
                                   head_of=("sb-aaaaaaaaaaaa", "b1"))
    record = registry.get_sandbox("sb-aaaaaaaaaaaa")
    assert record is not None and record.branch_head is None and record.head == "base"


def test_running_state_moves_out_of_sandbox_meta(tmp_path: Path) -> None:
    """A schema-4 database kept the deadline, the BRANCH head and re-adoption time in meta."""
    registry = Registry(tmp_path / "state.db")
    registry.close()
    db = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    db.execute("PRAGMA user_version = 4")
    db.execute("DROP TABLE fork_keys")  # and what schema 6 added
    for column in ("end_at", "branch_head", "readopted_at", "owner"):
        db.execute(f"ALTER TABLE sandboxes DROP COLUMN {column}")
    db.execute("INSERT INTO sandboxes (id, snapshot_tag, status, pid, run_dir, created_at, meta) VALUES "
               "('sb-aaaaaaaaaaaa', 'base', 'running', 1, '/r', 1.0, "
               "'{\"hostname\": \"h\", \"end_at\": 5.0, \"branch_head\": \"b1\", \"readopted_at\": 3.0}')")
    db.close()
    record = Registry(tmp_path / "state.db").get_sandbox("sb-aaaaaaaaaaaa")
    assert record is not None and record.meta == {"hostname": "h"}
    assert (record.end_at, record.branch_head, record.readopted_at) == (5.0, "b1", 3.0)


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
    assert (record.id, record.pid, record.vmm_started, record.vmm_state) == ("sb-oldoldoldold", 7, None, None)
    registry.set_vmm("sb-oldoldoldold", 8, 12345, {"monitor_socket": "/x/qmp.sock", "disk": "/x/disk.qcow2"})
    record = registry.get_sandbox("sb-oldoldoldold")
    assert record is not None
    assert (record.pid, record.vmm_started, record.vmm_state) == (
        8, 12345, {"monitor_socket": "/x/qmp.sock", "disk": "/x/disk.qcow2"})
    registry.close()
    Registry(db_path).close()  # opening an upgraded database again changes nothing


def test_qemu_columns_of_an_unversioned_database_move_into_the_backend_state(tmp_path: Path) -> None:
    """A sandbox a daemon before the schema version left running keeps what re-adopting it needs."""
    db_path = tmp_path / "state.db"
    old = sqlite3.connect(db_path)
    old.executescript("""
        CREATE TABLE sandboxes (id TEXT PRIMARY KEY, snapshot_tag TEXT NOT NULL, status TEXT NOT NULL, pid INTEGER,
                                run_dir TEXT NOT NULL, created_at REAL NOT NULL, meta TEXT NOT NULL,
                                vmm_started INTEGER, agent_socket TEXT, monitor_socket TEXT);
        INSERT INTO sandboxes VALUES ('sb-runningold00', 'base', 'running', 7, '/s/sb-runningold00', 1.0, '{}',
                                      99, '/s/sb-runningold00/agent.sock', '/s/sb-runningold00/qmp.sock');
        INSERT INTO sandboxes VALUES ('sb-startingold0', 'base', 'starting', NULL, '/s/sb-startingold0', 2.0, '{}',
                                      NULL, NULL, NULL);
    """)
    old.commit()
    old.close()
    registry = Registry(db_path)
    running, starting = registry.list_sandboxes()
    assert running.vmm_started == 99
    assert running.vmm_state == {"monitor_socket": "/s/sb-runningold00/qmp.sock"}  # the backend finds its disk
    assert starting.vmm_state is None
    registry.close()
    db = sqlite3.connect(db_path)
    columns = {row[1] for row in db.execute("PRAGMA table_info(sandboxes)")}
    assert "monitor_socket" not in columns and "agent_socket" not in columns
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()


def test_a_database_from_a_newer_forkd_is_refused(tmp_path: Path) -> None:
    db_path = tmp_path / "state.db"
    Registry(db_path).close()
    db = sqlite3.connect(db_path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(SchemaTooNew, match="upgrade forkd"):
        Registry(db_path)


def test_publish_snapshots_is_all_or_nothing(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state.db")
    registry.add_snapshot(SnapshotRecord("old", "ready", "default", tmp_path / "old", 1.0))
    registry.add_snapshot(SnapshotRecord("other", "ready", "default", tmp_path / "other", 1.0))
    registry.add_snapshot(SnapshotRecord("branch", "writing", "default", tmp_path / "branch", 1.0))
    clash = [SnapshotRecord("new", "ready", "default", tmp_path, 2.0), SnapshotRecord("other", "ready", "d", tmp_path, 2.0)]
    with pytest.raises(sqlite3.IntegrityError):
        registry.publish_snapshots(clash, remove=("old",))
    assert [r.tag for r in registry.list_snapshots()] == ["old", "other", "branch"]
    registry.publish_snapshots([SnapshotRecord("old", "ready", "default", tmp_path / "new", 3.0),
                                SnapshotRecord("branch", "ready", "default", tmp_path / "branch", 3.0, {"m": 1})],
                               remove=("old",))
    record = registry.get_snapshot("old")
    assert record is not None and record.path == tmp_path / "new"
    branch = registry.get_snapshot("branch")  # its own `writing` record is replaced by the ready one
    assert branch is not None and (branch.status, branch.meta) == ("ready", {"m": 1})


def test_an_unversioned_database_is_migrated_in_order_and_state_leaves_meta(tmp_path: Path) -> None:
    """A state.db from before schema versions: snapshots without parent_tag (an unpacked chain kept its
    parent only in meta) and a failed branch with its error in meta."""
    db_path = tmp_path / "state.db"
    old = sqlite3.connect(db_path)
    old.executescript("""
        CREATE TABLE snapshots (tag TEXT PRIMARY KEY, status TEXT NOT NULL, image TEXT NOT NULL, path TEXT NOT NULL,
                                created_at REAL NOT NULL, meta TEXT NOT NULL);
        INSERT INTO snapshots VALUES ('base', 'ready', 'default', '/s/base', 1.0, '{"sha256": {}}');
        INSERT INTO snapshots VALUES ('child', 'ready', 'default', '/s/child', 2.0,
                                      '{"parent_tag": "base", "sha256": {}}');
        INSERT INTO snapshots VALUES ('broken', 'failed', 'default', '/s/broken', 3.0,
                                      '{"mode": "diff", "error": "capture failed"}');
    """)
    old.commit()
    old.close()
    registry = Registry(db_path)
    assert schema_version(sqlite3.connect(db_path)) == SCHEMA_VERSION == len(MIGRATIONS)
    child, broken = registry.get_snapshot("child"), registry.get_snapshot("broken")
    assert child is not None and broken is not None
    assert (child.parent_tag, child.meta) == ("base", {"sha256": {}})
    assert registry.snapshot_children("base") == ["child"]  # so `rmi base` knows its dependent
    assert (broken.error, broken.meta, broken.to_dict()["error"]) == ("capture failed", {"mode": "diff"}, "capture failed")
    registry.close()
    assert migrate(sqlite3.connect(db_path, isolation_level=None)) == []  # opening again changes nothing


def test_address_leases_are_unique_under_concurrency_and_persist(tmp_path: Path) -> None:
    import threading

    from forkd.store.registry import LeasesExhausted

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


def test_connections_of_ended_threads_are_closed(tmp_path: Path) -> None:
    """Each thread has its own connection; a long-running daemon must not keep those of threads
    that ended (each holds the database and its log open)."""
    registry = Registry(tmp_path / "state.db")

    def open_files() -> int:
        return sum(1 for fd in Path("/proc/self/fd").iterdir() if str(fd.resolve(strict=False)).startswith(str(tmp_path)))

    baseline = open_files()
    for _ in range(5):
        worker = threading.Thread(target=registry.list_snapshots)
        worker.start()
        worker.join()
    assert open_files() <= baseline + 2  # each new connection closed those of the threads before
    registry.close()
    assert open_files() == 0


def test_closing_never_closes_a_connection_under_a_running_query(tmp_path: Path) -> None:
    """The daemon closes its registry while a worker thread may still be inside a query (a sandbox's
    release): that connection is closed by its own thread once the query ends, never under it (which
    crashed the sqlite3 module in CI); a query begun after the close is refused."""
    registry = Registry(tmp_path / "state.db")
    inside, closed, done = threading.Event(), threading.Event(), threading.Event()
    outcome: list[object] = []

    def worker() -> None:
        try:
            with registry._transaction() as db:
                inside.set()
                closed.wait(10)
                db.execute("SELECT count(*) FROM snapshots").fetchall()
            outcome.append("done")
        except Exception as exc:  # recorded for the assertion below
            outcome.append(exc)
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    assert inside.wait(10)
    registry.close()
    closed.set()
    assert done.wait(10)
    thread.join(10)
    assert outcome == ["done"]
    assert registry._connections == {}  # the worker closed its own once its query ended
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        registry.list_snapshots()
