"""The daemon's record of snapshots, sandboxes, workspaces and address leases, in SQLite (schema: store/schema.py).

Every change is one transaction, so a crash leaves either the old or the new record, never half
of one. Files on disk are published first (atomic rename) and registered second, so a registered
snapshot always has its files.
"""

from __future__ import annotations

import collections
import json
import sqlite3
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd.store.schema import SCHEMA, migrate
from forkd.vmm.base import Q35

_SANDBOX_FIELDS = ("id, snapshot_tag, status, pid, run_dir, created_at, meta, vmm_started, vmm_state, end_at, "
                   "branch_head, readopted_at, owner")
_SNAPSHOT_FIELDS = "tag, status, image, path, created_at, meta, parent_tag, error"


class LeasesExhausted(RuntimeError):
    """No address block is free in the pool."""


@dataclass
class SnapshotRecord:
    tag: str
    status: str
    image: str
    path: Path
    created_at: float
    meta: dict[str, Any] = field(default_factory=dict)  # exactly its meta.json: written once, never changed
    parent_tag: str | None = None  # the snapshot this one was branched from: the one record of its parent
    error: str | None = None  # why a ``failed`` snapshot failed

    @property
    def machine(self) -> str:
        """Its children's machine type (q35, microvm), the one reader of it in a snapshot's meta; q35 if older."""
        return str((self.meta.get("boot") or {}).get("machine") or Q35)

    def to_dict(self) -> dict[str, Any]:
        described = {**self.meta, "tag": self.tag, "status": self.status, "image": self.image, "path": str(self.path),
                     "created_at": self.created_at, "parent_tag": self.parent_tag, "machine": self.machine}
        return described if self.error is None else {**described, "error": self.error}


PRIVATE_SANDBOX_META = frozenset({"envs"})  # may hold secrets: used by the daemon, never returned


@dataclass
class WorkspaceRecord:
    name: str
    state: str  # "running" or "suspended"
    sandbox_id: str | None  # while running
    snapshot_tag: str  # what it runs from, or was suspended to
    created_at: float
    meta: dict[str, Any] = field(default_factory=dict)  # base tag, suspend snapshots, counts

    def to_dict(self) -> dict[str, Any]:
        public = {k: v for k, v in self.meta.items() if k not in PRIVATE_SANDBOX_META}
        return {"name": self.name, "state": self.state, "sandbox_id": self.sandbox_id,
                "snapshot_tag": self.snapshot_tag, "created_at": self.created_at, **public}


@dataclass
class SandboxRecord:
    id: str
    snapshot_tag: str
    status: str
    pid: int | None
    run_dir: Path
    created_at: float
    meta: dict[str, Any] = field(default_factory=dict)
    vmm_started: int | None = None  # clock ticks after boot, from /proc/PID/stat
    vmm_state: dict[str, Any] | None = None  # the backend's own VmHandle.state, for re-adoption
    end_at: float | None = None  # when the daemon kills it (its timeout); None: never
    branch_head: str | None = None  # the snapshot its last BRANCH wrote: the next one chains onto it
    readopted_at: float | None = None  # when a restarted daemon found it running and took it back
    owner: str | None = None  # the label of whoever forked it (a driver's job id), to reap its children together

    @property
    def head(self) -> str:
        """The snapshot the sandbox's memory and disk now derive from: what a BRANCH chains onto."""
        return self.branch_head or self.snapshot_tag

    def to_dict(self) -> dict[str, Any]:
        public = {k: v for k, v in self.meta.items() if k not in PRIVATE_SANDBOX_META}
        described = {"id": self.id, "snapshot_tag": self.snapshot_tag, "status": self.status, "pid": self.pid,
                     "created_at": self.created_at, "end_at": self.end_at, "owner": self.owner, **public}
        if self.readopted_at is not None:
            described["readopted_at"] = self.readopted_at
        return described


class Registry:
    """Access to ``state.db`` from any thread; the daemon holds one instance.

    Each thread gets its own connection, and the database runs in WAL mode: readers never wait for
    a writer, and no Python lock is shared between the event loop and worker threads. SQLite
    serializes writers itself (each waits up to ``BUSY_TIMEOUT_S`` for the other).
    """

    BUSY_TIMEOUT_S = 30.0

    def __init__(self, db_path: Path) -> None:
        db_path.parent.mkdir(parents=True, exist_ok=True)
        self._path = db_path
        self._local = threading.local()
        self._connections: dict[threading.Thread, sqlite3.Connection] = {}
        self._guard = threading.Lock()  # only around the table of connections, never around a query
        self._busy: collections.Counter[threading.Thread] = collections.Counter()  # threads inside a query
        self._closed = False
        db = self._db
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)
            migrate(db)
        except BaseException:
            self.close()
            raise

    @property
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            with self._guard:
                if self._closed:
                    raise sqlite3.ProgrammingError("the registry is closed")
                self._close_connections_of_ended_threads()
                db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None,
                                     timeout=self.BUSY_TIMEOUT_S)
                db.execute("PRAGMA synchronous=NORMAL")
                self._connections[threading.current_thread()] = db
            self._local.db = db
        return db

    def close(self) -> None:
        """No query starts from now on; every connection is closed, a busy one by its own thread once its
        query ends (closing a connection under another thread's running query crashes the sqlite3 module)."""
        with self._guard:
            self._closed = True
            for thread in [thread for thread in self._connections if thread not in self._busy]:
                self._connections.pop(thread).close()

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection, marked busy for as long as the caller uses it."""
        me = threading.current_thread()
        with self._guard:
            if self._closed:
                raise sqlite3.ProgrammingError("the registry is closed")
            self._busy[me] += 1
        try:
            yield self._db
        finally:
            with self._guard:
                self._busy[me] -= 1
                if not self._busy[me]:
                    del self._busy[me]
                    if self._closed and me in self._connections:
                        self._connections.pop(me).close()

    def _close_connections_of_ended_threads(self) -> None:
        """A thread that ended cannot use its connection again: close it, so short-lived threads
        cannot pile up open database files in a long-running daemon."""
        for thread in [thread for thread in self._connections if not thread.is_alive()]:
            self._connections.pop(thread).close()

    def _execute(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._connection() as db:
            return db.execute(sql, params).fetchall()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` on this thread's connection: all of it or none of it."""
        with self._connection() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    # snapshots

    def add_snapshot(self, record: SnapshotRecord) -> None:
        self._execute(_INSERT_SNAPSHOT, _snapshot_row(record))

    def publish_snapshots(self, records: list[SnapshotRecord], remove: tuple[str, ...] = (),
                          head_of: tuple[str, str] | None = None) -> None:
        """In one transaction: remove the ``remove`` tags, register ``records`` (each new, or replacing
        its own ``writing`` record), and point a sandbox's branch head at a tag (``head_of``: id, tag).
        A tag registered otherwise fails it all."""
        with self._transaction() as db:
            for tag in remove:
                db.execute("DELETE FROM snapshots WHERE tag = ?", (tag,))
            for record in records:
                db.execute("DELETE FROM snapshots WHERE tag = ? AND status = 'writing'", (record.tag,))
                db.execute(_INSERT_SNAPSHOT, _snapshot_row(record))
            if head_of is not None:
                db.execute("UPDATE sandboxes SET branch_head = ? WHERE id = ?", (head_of[1], head_of[0]))

    def update_snapshot(self, tag: str, *, status: str, error: str | None = None,
                        parent_tag: str | None = None) -> None:
        """Set a snapshot's status, and its error and parent link when given, in one statement."""
        sets, params = ["status = ?"], [status]
        if error is not None:
            sets.append("error = ?")
            params.append(error)
        if parent_tag is not None:
            sets.append("parent_tag = ?")
            params.append(parent_tag)
        self._execute(f"UPDATE snapshots SET {', '.join(sets)} WHERE tag = ?", (*params, tag))

    def replace_snapshot_meta(self, tag: str, created_at: float, old: dict[str, Any], new: dict[str, Any]) -> bool:
        """Compare and set a ready snapshot's meta: a digest computed after publishing lands only on that snapshot."""
        with self._connection() as db:
            return db.execute("UPDATE snapshots SET meta = ? WHERE tag = ? AND created_at = ? AND status = 'ready' "
                              "AND meta = ?", (json.dumps(new), tag, created_at, json.dumps(old))).rowcount == 1

    def snapshot_children(self, tag: str) -> list[str]:
        return [r[0] for r in self._execute("SELECT tag FROM snapshots WHERE parent_tag = ? ORDER BY created_at",
                                            (tag,))]

    def get_snapshot(self, tag: str) -> SnapshotRecord | None:
        rows = self._execute(f"SELECT {_SNAPSHOT_FIELDS} FROM snapshots WHERE tag = ?", (tag,))
        return _snapshot(rows[0]) if rows else None

    def list_snapshots(self) -> list[SnapshotRecord]:
        rows = self._execute(f"SELECT {_SNAPSHOT_FIELDS} FROM snapshots ORDER BY created_at")
        return [_snapshot(r) for r in rows]

    def remove_snapshot(self, tag: str) -> None:
        self._execute("DELETE FROM snapshots WHERE tag = ?", (tag,))

    # sandboxes

    def add_sandbox(self, record: SandboxRecord) -> None:
        """One insert with everything, VMM included: a fork writes each child's record once."""
        self._execute(
            f"INSERT INTO sandboxes ({_SANDBOX_FIELDS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (record.id, record.snapshot_tag, record.status, record.pid, str(record.run_dir), record.created_at,
             json.dumps(record.meta), record.vmm_started,
             None if record.vmm_state is None else json.dumps(record.vmm_state), record.end_at, record.branch_head,
             record.readopted_at, record.owner),
        )

    def set_end_at(self, sandbox_id: str, end_at: float | None) -> None:
        self._execute("UPDATE sandboxes SET end_at = ? WHERE id = ?", (end_at, sandbox_id))

    def set_vmm(self, sandbox_id: str, pid: int, started: int | None, vmm_state: dict[str, Any]) -> None:
        """Record the VMM of a sandbox, everything a restarted daemon needs to find and reconnect it."""
        self._execute("UPDATE sandboxes SET pid = ?, vmm_started = ?, vmm_state = ? WHERE id = ?",
                      (pid, started, json.dumps(vmm_state), sandbox_id))

    def set_readopted(self, sandbox_id: str, at: float) -> None:
        self._execute("UPDATE sandboxes SET readopted_at = ? WHERE id = ?", (at, sandbox_id))

    def set_labels(self, sandbox_id: str, labels: dict[str, str]) -> None:
        """Replace a sandbox's labels (``meta.metadata``) in place, the rest of its meta untouched."""
        self._execute("UPDATE sandboxes SET meta = json_set(meta, '$.metadata', json(?)) WHERE id = ?",
                      (json.dumps(labels), sandbox_id))

    def set_egress(self, sandbox_id: str, egress: dict[str, Any]) -> None:
        """A running sandbox's new egress policy (``meta.net.egress``), the rest of its meta untouched."""
        self._execute("UPDATE sandboxes SET meta = json_set(meta, '$.net.egress', json(?)) WHERE id = ?",
                      (json.dumps(egress), sandbox_id))

    def set_branch_refused(self, sandbox_id: str, reason: str) -> None:
        """Why a sandbox may not be branched again (``meta.branch_refused``), the rest of its meta untouched."""
        self._execute("UPDATE sandboxes SET meta = json_set(meta, '$.branch_refused', ?) WHERE id = ?",
                      (reason, sandbox_id))

    def set_vmm_state(self, sandbox_id: str, vmm_state: dict[str, Any]) -> None:
        """The backend's state of a running VMM changed (a BRANCH moved its disk to a new overlay)."""
        self._execute("UPDATE sandboxes SET vmm_state = ? WHERE id = ?", (json.dumps(vmm_state), sandbox_id))

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        rows = self._execute(f"SELECT {_SANDBOX_FIELDS} FROM sandboxes WHERE id = ?", (sandbox_id,))
        return _sandbox(rows[0]) if rows else None

    def list_sandboxes(self) -> list[SandboxRecord]:
        rows = self._execute(f"SELECT {_SANDBOX_FIELDS} FROM sandboxes ORDER BY created_at")
        return [_sandbox(r) for r in rows]

    def remove_sandbox(self, sandbox_id: str) -> None:
        self._execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    # pools of ready VMMs

    def pool_sizes(self) -> dict[str, int]:
        return {tag: size for tag, size in self._execute("SELECT tag, size FROM pools")}

    def set_pool_size(self, tag: str, size: int | None) -> None:
        """Keep ``size`` ready VMMs of ``tag``; ``None`` forgets the tag's pool altogether."""
        if size is None:
            self._execute("DELETE FROM pools WHERE tag = ?", (tag,))
        else:
            self._execute("INSERT INTO pools (tag, size) VALUES (?, ?) ON CONFLICT(tag) DO UPDATE SET size = ?",
                          (tag, size, size))

    # forks made with an idempotency key

    def recall_fork(self, key: str, since: float) -> tuple[str, dict[str, Any]] | None:
        """``(fingerprint, answer)`` of the fork made with ``key`` at or after ``since``, if any."""
        rows = self._execute("SELECT fingerprint, answer FROM fork_keys WHERE key = ? AND created_at >= ?",
                             (key, since))
        return (rows[0][0], json.loads(rows[0][1])) if rows else None

    def remember_fork(self, key: str, fingerprint: str, answer: dict[str, Any], now: float, since: float,
                      keep: int) -> None:
        """Keep the answer of the fork made with ``key``; keys older than ``since``, and all but the newest
        ``keep``, are forgotten meanwhile (the oldest first)."""
        with self._transaction() as db:
            db.execute("DELETE FROM fork_keys WHERE created_at < ?", (since,))
            db.execute("INSERT OR REPLACE INTO fork_keys (key, fingerprint, answer, created_at) VALUES (?, ?, ?, ?)",
                       (key, fingerprint, json.dumps(answer), now))
            db.execute("DELETE FROM fork_keys WHERE rowid IN (SELECT rowid FROM fork_keys "
                       "ORDER BY created_at DESC, rowid DESC LIMIT -1 OFFSET ?)", (keep,))

    def forget_fork(self, key: str) -> None:
        self._execute("DELETE FROM fork_keys WHERE key = ?", (key,))

    # network address leases

    def lease_slot(self, sandbox_id: str, pool: str, capacity: int, taken: Collection[int] = ()) -> int:
        """The lowest slot of ``pool`` that no sandbox holds and is not in ``taken``, now held by ``sandbox_id``.

        One immediate transaction: concurrent forks (and another daemon on the same db) never get one slot twice.
        """
        with self._transaction() as db:
            held = {row[0] for row in db.execute("SELECT slot FROM net_leases WHERE pool = ?", (pool,))}
            slot = next((i for i in range(capacity) if i not in held and i not in taken), None)
            if slot is None:
                raise LeasesExhausted(f"all {capacity} address blocks of {pool} are in use; kill sandboxes "
                                      f"or set a larger network.pool (FORKD_NET_POOL)")
            db.execute("INSERT INTO net_leases (pool, slot, sandbox_id) VALUES (?, ?, ?)", (pool, slot, sandbox_id))
        return slot

    def release_slot(self, sandbox_id: str) -> None:
        self._execute("DELETE FROM net_leases WHERE sandbox_id = ?", (sandbox_id,))

    # workspaces

    def put_workspace(self, record: WorkspaceRecord) -> None:
        """Insert or replace the whole record (one statement: a crash leaves the old or the new one)."""
        self._execute("INSERT OR REPLACE INTO workspaces (name, state, sandbox_id, snapshot_tag, created_at, meta) "
                      "VALUES (?, ?, ?, ?, ?, ?)", (record.name, record.state, record.sandbox_id, record.snapshot_tag,
                                                   record.created_at, json.dumps(record.meta)))

    def get_workspace(self, name: str) -> WorkspaceRecord | None:
        rows = self._execute("SELECT name, state, sandbox_id, snapshot_tag, created_at, meta FROM workspaces "
                             "WHERE name = ?", (name,))
        return _workspace(rows[0]) if rows else None

    def list_workspaces(self) -> list[WorkspaceRecord]:
        rows = self._execute("SELECT name, state, sandbox_id, snapshot_tag, created_at, meta FROM workspaces "
                             "ORDER BY created_at")
        return [_workspace(r) for r in rows]

    def remove_workspace(self, name: str) -> None:
        self._execute("DELETE FROM workspaces WHERE name = ?", (name,))

    def leases(self) -> dict[str, tuple[str, int]]:
        """Sandbox id → (pool, slot) of every lease held."""
        return {row[2]: (row[0], row[1]) for row in self._execute("SELECT pool, slot, sandbox_id FROM net_leases")}



_INSERT_SNAPSHOT = f"INSERT INTO snapshots ({_SNAPSHOT_FIELDS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"


def _snapshot_row(record: SnapshotRecord) -> tuple[Any, ...]:
    return (record.tag, record.status, record.image, str(record.path), record.created_at, json.dumps(record.meta),
            record.parent_tag, record.error)


def _workspace(row: tuple[Any, ...]) -> WorkspaceRecord:
    return WorkspaceRecord(name=row[0], state=row[1], sandbox_id=row[2], snapshot_tag=row[3], created_at=row[4],
                           meta=json.loads(row[5]))


def _snapshot(row: tuple[Any, ...]) -> SnapshotRecord:
    return SnapshotRecord(tag=row[0], status=row[1], image=row[2], path=Path(row[3]), created_at=row[4],
                          meta=json.loads(row[5]), parent_tag=row[6], error=row[7])


def _sandbox(row: tuple[Any, ...]) -> SandboxRecord:
    return SandboxRecord(id=row[0], snapshot_tag=row[1], status=row[2], pid=row[3], run_dir=Path(row[4]),
                         created_at=row[5], meta=json.loads(row[6]), vmm_started=row[7],
                         vmm_state=json.loads(row[8]) if row[8] else None, end_at=row[9], branch_head=row[10],
                         readopted_at=row[11], owner=row[12])
