"""state.db's schema: the unversioned shape and the migrations that bring any older database up to date.

Each migration runs in its own transaction, in order (``PRAGMA user_version`` counts those applied);
a database written by a newer forkd is refused rather than misread.
"""

from __future__ import annotations

import json
import sqlite3

# The unversioned shape (what forkd created before schema versions); MIGRATIONS bring it up to date.
SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    tag        TEXT PRIMARY KEY,
    status     TEXT NOT NULL,
    image      TEXT NOT NULL,
    path       TEXT NOT NULL,
    created_at REAL NOT NULL,
    meta       TEXT NOT NULL,
    parent_tag TEXT
);
CREATE TABLE IF NOT EXISTS sandboxes (
    id           TEXT PRIMARY KEY,
    snapshot_tag TEXT NOT NULL,
    status       TEXT NOT NULL,
    pid          INTEGER,
    run_dir      TEXT NOT NULL,
    created_at   REAL NOT NULL,
    meta         TEXT NOT NULL
);
-- A named long-lived sandbox: running as sandbox_id, or suspended to snapshot_tag (its VMM gone).
CREATE TABLE IF NOT EXISTS workspaces (
    name         TEXT PRIMARY KEY,
    state        TEXT NOT NULL,
    sandbox_id   TEXT,
    snapshot_tag TEXT NOT NULL,
    created_at   REAL NOT NULL,
    meta         TEXT NOT NULL
);
-- One /30 of the nat address pool per sandbox; kept across daemon restarts so leftovers are known.
CREATE TABLE IF NOT EXISTS net_leases (
    pool       TEXT NOT NULL,
    slot       INTEGER NOT NULL,
    sandbox_id TEXT NOT NULL UNIQUE,
    PRIMARY KEY (pool, slot)
);
"""


def _add_columns(db: sqlite3.Connection) -> None:
    """1: columns added before the schema had a version (snapshot chains; re-adoption after a restart)."""
    for table, name, sql_type in (("snapshots", "parent_tag", "TEXT"), ("sandboxes", "vmm_started", "INTEGER"),
                                  ("sandboxes", "agent_socket", "TEXT"), ("sandboxes", "monitor_socket", "TEXT")):
        if name not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {sql_type}")


def _vmm_state_blob(db: sqlite3.Connection) -> None:
    """2: what a backend needs to re-adopt its VMM is its own opaque JSON (``VmHandle.state``), not
    QEMU columns. Records written by the QEMU backend before keep their monitor socket (their disk is
    the backend's first one in the run directory, which it finds itself)."""
    db.execute("ALTER TABLE sandboxes ADD COLUMN vmm_state TEXT")
    rows = db.execute("SELECT id, monitor_socket FROM sandboxes WHERE monitor_socket IS NOT NULL")
    for sandbox_id, monitor_socket in rows.fetchall():
        state = {"monitor_socket": monitor_socket}
        db.execute("UPDATE sandboxes SET vmm_state = ? WHERE id = ?", (json.dumps(state), sandbox_id))
    db.execute("ALTER TABLE sandboxes DROP COLUMN agent_socket")
    db.execute("ALTER TABLE sandboxes DROP COLUMN monitor_socket")


def _snapshot_state_out_of_meta(db: sqlite3.Connection) -> None:
    """3: a snapshot's ``meta`` is exactly its meta.json; what changes lives in columns. A failure's
    message moves to ``error``; the parent link lives only in ``parent_tag`` (chains unpacked by
    earlier releases had it only in meta, so ``rmi`` of their base did not see them)."""
    db.execute("ALTER TABLE snapshots ADD COLUMN error TEXT")
    db.execute("UPDATE snapshots SET parent_tag = json_extract(meta, '$.parent_tag') "
               "WHERE parent_tag IS NULL AND json_extract(meta, '$.parent_tag') IS NOT NULL")
    db.execute("UPDATE snapshots SET error = json_extract(meta, '$.error') WHERE json_extract(meta, '$.error') IS NOT NULL")
    db.execute("UPDATE snapshots SET meta = json_remove(meta, '$.parent_tag', '$.error')")


def _pools_table(db: sqlite3.Connection) -> None:
    """4: how many ready VMMs to keep per snapshot (runtime/pool.py), as set through the API."""
    db.execute("CREATE TABLE pools (tag TEXT PRIMARY KEY, size INTEGER NOT NULL)")


def _sandbox_state_out_of_meta(db: sqlite3.Connection) -> None:
    """5: a sandbox's ``meta`` is written once, when it answers; what changes while it runs lives in
    columns: its deadline, the snapshot its next BRANCH chains onto, when a restarted daemon re-adopted it."""
    for name, sql_type in (("end_at", "REAL"), ("branch_head", "TEXT"), ("readopted_at", "REAL")):
        db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {sql_type}")
        db.execute(f"UPDATE sandboxes SET {name} = json_extract(meta, '$.{name}')")
    db.execute("UPDATE sandboxes SET meta = json_remove(meta, '$.end_at', '$.branch_head', '$.readopted_at')")


def _owners_and_fork_keys(db: sqlite3.Connection) -> None:
    """6: a sandbox's ``owner`` (the label of the driver that forked it, so its children can be reaped
    together), and the answers of forks made with an idempotency key (a retried fork is answered the
    same, never forks again)."""
    db.execute("ALTER TABLE sandboxes ADD COLUMN owner TEXT")
    db.execute("CREATE TABLE fork_keys (key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, answer TEXT NOT NULL, "
               "created_at REAL NOT NULL)")


#: Schema migrations, in order: step N brings ``PRAGMA user_version`` from N-1 to N in one
#: transaction. A new database is created in the unversioned shape and migrated like any other.
MIGRATIONS = (_add_columns, _vmm_state_blob, _snapshot_state_out_of_meta, _pools_table, _sandbox_state_out_of_meta,
              _owners_and_fork_keys)
SCHEMA_VERSION = len(MIGRATIONS)


class SchemaTooNew(RuntimeError):
    """state.db was written by a newer forkd; this one would misread it."""


def schema_version(db: sqlite3.Connection) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def migrate(db: sqlite3.Connection) -> list[int]:
    """Apply the migrations ``db`` lacks, each in its own transaction, in order; returns those applied."""
    version = schema_version(db)
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(f"state.db has schema version {version}, this forkd knows up to {SCHEMA_VERSION}; "
                           "upgrade forkd or use another FORKD_HOME")
    applied = []
    for number in range(version + 1, SCHEMA_VERSION + 1):
        db.execute("BEGIN IMMEDIATE")
        try:
            if schema_version(db) >= number:  # another process migrated it meanwhile
                db.execute("ROLLBACK")
                continue
            MIGRATIONS[number - 1](db)
            db.execute(f"PRAGMA user_version = {number}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        applied.append(number)
    return applied
