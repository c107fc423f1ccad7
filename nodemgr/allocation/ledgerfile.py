"""The ledger's file: its schema, its rows as SQL, and what can be told about the file.

Translation and file facts for nodemgr.allocation.ledger, which owns the connection,
the lock and every decision.

What it must not do: hold state or decide anything; the Ledger calls it under
its lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import tempfile
import weakref
from collections.abc import Iterable, Mapping

from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import (
    Allocation,
    CgroupKey,
    ClaimRef,
    ClaimResult,
    ContainerRef,
    Registration,
)
from nodemgr.errors import LedgerError

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS allocations (
    id TEXT PRIMARY KEY,
    memory_mib INTEGER NOT NULL,
    created_at REAL NOT NULL,
    namespace TEXT,
    pod TEXT,
    container TEXT,
    confirmed_at REAL,
    pod_uid TEXT
);
CREATE TABLE IF NOT EXISTS devices (
    kind TEXT NOT NULL,
    device_id TEXT NOT NULL,
    allocation_id TEXT NOT NULL REFERENCES allocations(id) ON DELETE CASCADE,
    PRIMARY KEY (kind, device_id)
);
CREATE INDEX IF NOT EXISTS devices_by_allocation ON devices(allocation_id);
-- The DRA ResourceClaim an allocation was made for (docs/dra.md); results: JSON list of
-- {request, pool, device, share_id}. Gone with its allocation.
CREATE TABLE IF NOT EXISTS claims (
    allocation_id TEXT PRIMARY KEY REFERENCES allocations(id) ON DELETE CASCADE,
    uid TEXT NOT NULL UNIQUE,
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    results TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS containers (
    id TEXT PRIMARY KEY,
    allocation_id TEXT NOT NULL,
    cgroup_hierarchy TEXT NOT NULL,
    cgroup_path TEXT NOT NULL,
    init_pid INTEGER NOT NULL,
    init_start_ticks INTEGER NOT NULL,
    namespace TEXT,
    pod TEXT,
    container TEXT,
    registered_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS violations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    action TEXT NOT NULL,
    card TEXT NOT NULL,
    allocation_id TEXT,
    container_id TEXT,
    namespace TEXT,
    pod TEXT,
    container TEXT,
    pids TEXT NOT NULL,
    used_mib INTEGER NOT NULL,
    quota_mib INTEGER NOT NULL,
    detail TEXT NOT NULL
);
"""


# Schema 3.
POD_UID_COLUMN = "ALTER TABLE allocations ADD COLUMN pod_uid TEXT"


def has_pod_uid_column(db: sqlite3.Connection) -> bool:
    """False for an older ledger opened read-only, not upgraded."""
    return any(row[1] == "pod_uid" for row in db.execute("PRAGMA table_info(allocations)"))


def read_allocations(db: sqlite3.Connection, path: str) -> list[Allocation]:
    pod_uid = "pod_uid" if has_pod_uid_column(db) else "NULL"
    rows = db.execute(
        "SELECT id, memory_mib, created_at, namespace, pod, container, confirmed_at,"
        f" {pod_uid} FROM allocations ORDER BY created_at, id"
    ).fetchall()
    device_rows = db.execute("SELECT allocation_id, kind, device_id FROM devices").fetchall()
    devices: dict[str, dict[ResourceKind, list[str]]] = {}
    for allocation_id, kind, device_id in device_rows:
        try:
            resource_kind = ResourceKind(kind)
        except ValueError as e:
            raise LedgerError(
                f"the ledger {path} holds device {device_id} of unknown kind {kind!r}"
            ) from e
        devices.setdefault(allocation_id, {}).setdefault(resource_kind, []).append(device_id)
    claims = read_claims(db, path)
    allocations = []
    for id_, memory_mib, created_at, namespace, pod, container, confirmed_at, uid in rows:
        owner = ContainerRef(namespace, pod, container) if pod is not None else None
        allocations.append(
            Allocation(
                id=id_,
                devices={k: tuple(sorted(v)) for k, v in devices.get(id_, {}).items()},
                memory_mib=memory_mib,
                created_at=created_at,
                owner=owner,
                confirmed_at=confirmed_at,
                claim=claims.get(id_),
                owner_uid=uid or None,
            )
        )
    return allocations


def read_claims(db: sqlite3.Connection, path: str) -> dict[str, ClaimRef]:
    """Allocation ID -> its claim (none from a schema 1 ledger opened read-only)."""
    known = db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'claims'"
    ).fetchone()
    if known is None:
        return {}
    claims = {}
    for allocation_id, uid, namespace, name, results in db.execute(
        "SELECT allocation_id, uid, namespace, name, results FROM claims"
    ).fetchall():
        try:
            parsed = tuple(
                ClaimResult(
                    str(r["request"]),
                    str(r["pool"]),
                    str(r["device"]),
                    None if r.get("share_id") is None else str(r["share_id"]),
                )
                for r in json.loads(results)
            )
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise LedgerError(
                f"the ledger {path} holds claim {namespace}/{name} (allocation "
                f"{allocation_id}) with unreadable results {results!r}: {e}"
            ) from e
        claims[allocation_id] = ClaimRef(uid, namespace, name, parsed)
    return claims


def read_registrations(db: sqlite3.Connection) -> list[Registration]:
    rows = db.execute(
        "SELECT id, allocation_id, cgroup_hierarchy, cgroup_path, init_pid, init_start_ticks,"
        " namespace, pod, container, registered_at FROM containers ORDER BY registered_at, id"
    ).fetchall()
    return [
        Registration(
            container_id=row[0],
            allocation_id=row[1],
            cgroup=CgroupKey(row[2], row[3]),
            init_pid=row[4],
            init_start_ticks=row[5],
            identity=ContainerRef(row[6], row[7], row[8]) if row[7] is not None else None,
            registered_at=row[9],
        )
        for row in rows
    ]


def put_allocation(db: sqlite3.Connection, allocation: Allocation) -> None:
    db.execute(
        "INSERT INTO allocations (id, memory_mib, created_at, namespace, pod, container,"
        " confirmed_at, pod_uid) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(id) DO UPDATE SET memory_mib = excluded.memory_mib,"
        " namespace = excluded.namespace, pod = excluded.pod,"
        " container = excluded.container, confirmed_at = excluded.confirmed_at,"
        " pod_uid = excluded.pod_uid",
        (
            allocation.id,
            allocation.memory_mib,
            allocation.created_at,
            *ref_columns(allocation.owner),
            allocation.confirmed_at,
            allocation.owner_uid,
        ),
    )
    db.execute("DELETE FROM claims WHERE allocation_id = ?", (allocation.id,))
    claim = allocation.claim
    if claim is not None:
        results = [
            {"request": r.request, "pool": r.pool, "device": r.device, "share_id": r.share_id}
            for r in claim.results
        ]
        db.execute(
            "INSERT INTO claims (allocation_id, uid, namespace, name, results)"
            " VALUES (?, ?, ?, ?, ?)",
            (allocation.id, claim.uid, claim.namespace, claim.name, json.dumps(results)),
        )


def put_devices(db: sqlite3.Connection, allocation: Allocation) -> None:
    db.executemany(
        "INSERT INTO devices (kind, device_id, allocation_id) VALUES (?, ?, ?)",
        [(str(kind), device_id, allocation.id) for kind, device_id in allocation.device_pairs()],
    )


def put_registration(db: sqlite3.Connection, registration: Registration) -> None:
    db.execute(
        "INSERT OR REPLACE INTO containers (id, allocation_id, cgroup_hierarchy, cgroup_path,"
        " init_pid, init_start_ticks, namespace, pod, container, registered_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            registration.container_id,
            registration.allocation_id,
            registration.cgroup.hierarchy,
            registration.cgroup.path,
            registration.init_pid,
            registration.init_start_ticks,
            *ref_columns(registration.identity),
            registration.registered_at,
        ),
    )


def write_new_ledger(
    path: str,
    meta: Mapping[str, str],
    allocations: Iterable[Allocation],
    registrations: Iterable[Registration],
) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA foreign_keys=ON")
        db.executescript(SCHEMA)
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", meta.items())
        for allocation in allocations:
            put_allocation(db, allocation)
            put_devices(db, allocation)
        for registration in registrations:
            put_registration(db, registration)
        db.execute("COMMIT")
    finally:
        db.close()  # an unfinished transaction is rolled back


class FileHandle:
    """A descriptor of the ledger file to read its header through, never closed before
    the daemon's connection: closing any descriptor of a file drops all of this
    process's POSIX locks on it, SQLite's included."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        info = os.fstat(self._fd)
        self.file_id = (info.st_dev, info.st_ino)
        # Closed with the Ledger; also if a Ledger is dropped unclosed (tests).
        self.close = weakref.finalize(self, os.close, self._fd)

    def cut_short(self, size: int) -> bool:
        """Whether the file is shorter than the database size its header records (valid
        when the change counter equals version-valid-for). SQLite never shrinks the file
        (no VACUUM, no auto_vacuum), so a shorter one was cut."""
        header = os.pread(self._fd, 100, 0)
        if len(header) < 100:
            return size > 0  # less than a header: cut, unless nothing was checkpointed yet
        page_size = int.from_bytes(header[16:18], "big")
        counter, pages, valid_for = (int.from_bytes(header[o : o + 4], "big") for o in (24, 28, 92))
        return counter == valid_for and size < pages * (65536 if page_size == 1 else page_size)


def stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def remove(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def unused_name(base: str) -> str:
    """``base``, or ``base.N`` when a damaged copy of the same second is already kept."""
    name, n = base, 0
    while os.path.lexists(name):
        n += 1
        name = f"{base}.{n}"
    return name


def is_damage(error: sqlite3.Error) -> bool:
    """SQLITE_CORRUPT or SQLITE_NOTADB, not a write refused for another cause."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
        return True
    text = str(error)
    return "malformed" in text or "not a database" in text


def error_cause(error: sqlite3.Error, state_dir: str) -> str:
    """SQLite's message, with what to do for the causes an operator can fix."""
    text = str(error)
    code = getattr(error, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_FULL or "is full" in text:
        return (
            f"{text}: the file system of state_dir is full; free space there (nothing was written)"
        )
    if is_damage(error):
        # Damaged again right after a rebuild, or found by a read: said at every refusal.
        return f"{text}: the ledger file is damaged{RECOVERY_HINT}"
    io_error = code is not None and code & 0xFF == sqlite3.SQLITE_IOERR
    if "readonly" in text or "read-only" in text or (io_error and read_only(state_dir)):
        return f"{text}: state_dir is read-only; make it writable (nothing was written)"
    return text


def read_only(state_dir: str) -> bool:
    """Whether state_dir's file system refuses writes. One the kernel turned read-only
    under the open ledger (ext4's errors=remount-ro) gives SQLite a bare I/O error and
    still shows rw in its mount flags: only a write tells."""
    try:
        if os.statvfs(state_dir).f_flag & os.ST_RDONLY:
            return True
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=state_dir)
    except OSError as e:
        return e.errno == errno.EROFS
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return False


def ref_columns(ref: ContainerRef | None) -> tuple[str | None, str | None, str | None]:
    return (ref.namespace, ref.pod, ref.container) if ref else (None, None, None)


RECOVERY_HINT = (
    "; to recover, stop gpushare-node, move the file aside (keep it for a bug report) and "
    "start again: allocations kubelet still reports are adopted from its PodResources record "
    "and the running containers' registrations from their cgroup marks"
)
