"""The durable ledger: allocations, registered containers and the violation history.

Every change is one transaction, committed before Allocate answers kubelet,
so a crash or kill -9 of the daemon at any instant leaves either the whole
change or none of it. WAL with ``synchronous=NORMAL``: a commit is written to
the WAL (the kernel's page cache) but not fsync'd, so it survives any crash of
the daemon; only a power loss or kernel crash can take back the last commits.
That is the one case where every container on the node is gone too, and what
it takes back is recovered: kubelet's record is adopted at the first
reconcile, and a pod's container restarted with the env kubelet cached is tied
to its pod's allocation whatever ID that env names (nodemgr.domain.podtie).
The fsync per commit (FULL) cost more than all the rest of Allocate together.

The file is never rewritten or deleted by the daemon: a corrupt ledger stops
start-up with a message saying how to recover (move it aside; kubelet's record
is adopted at the next reconcile), and one damaged under the running daemon
(truncated) makes every refused write say the same. A write refused because
state_dir is full or read-only names that.

A ledger file deleted or replaced while the daemon runs (``rm -rf`` of
state_dir, an old copy restored over it) is noticed at the next write and at
every ``check_file`` (the run loop calls it each tick): the daemon's open
connection still reads the lost file, so the whole ledger is copied from it
into a new file at the same path (a replacement is first kept aside as
``ledger.sqlite.replaced-<time>``), and that is logged at CRITICAL.

What it must not do: decide anything; it stores what the allocator and the
enforcement say.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterable

from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation, CgroupKey, ContainerRef, Registration
from nodemgr.domain.violations import Violation
from nodemgr.errors import LedgerError

SCHEMA_VERSION = "1"
LEDGER_FILE = "ledger.sqlite"

_SCHEMA = """
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
    confirmed_at REAL
);
CREATE TABLE IF NOT EXISTS devices (
    kind TEXT NOT NULL,
    device_id TEXT NOT NULL,
    allocation_id TEXT NOT NULL REFERENCES allocations(id) ON DELETE CASCADE,
    PRIMARY KEY (kind, device_id)
);
CREATE INDEX IF NOT EXISTS devices_by_allocation ON devices(allocation_id);
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
# The violation history keeps this many rows, oldest dropped first.
VIOLATION_HISTORY_ROWS = 10000

log = logging.getLogger(__name__)


class Ledger:
    """Allocations on disk. Thread-safe; every method is one short transaction."""

    def __init__(self, state_dir: str, *, read_only: bool = False):
        self.path = os.path.join(state_dir, LEDGER_FILE)
        self._state_dir = state_dir
        self._read_only = read_only
        self._lock = threading.Lock()
        self._file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we write
        # True when this open made the ledger (none was there: a first start, or one lost).
        self.created = False
        try:
            if read_only:
                uri = f"file:{self.path}?mode=ro"
                self._db = sqlite3.connect(uri, uri=True, check_same_thread=False)
                self._db.execute("PRAGMA foreign_keys=ON")
                self._db.execute("PRAGMA busy_timeout=5000")
            else:
                os.makedirs(state_dir, mode=0o700, exist_ok=True)
                self._db = self._connect()
            self._check_integrity()
            if not read_only:
                self._db.executescript(_SCHEMA)
                self._check_schema_version()
        except sqlite3.Error as e:
            raise LedgerError(f"cannot open the ledger {self.path}: {e}{_RECOVERY_HINT}") from e
        except OSError as e:  # state_dir cannot be made: a file in the path, no permission
            raise LedgerError(
                f"cannot open the ledger {self.path}: cannot create its directory "
                f"{state_dir}: {e.strerror or e}; check state_dir in the config"
            ) from e

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # why: see the module docstring
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=5000")
        self._file_id = _file_id(self.path)
        return db

    def check_file(self) -> str | None:
        """Why the ledger file had to be rewritten just now (deleted or replaced under
        the running daemon); None when it is still the file this daemon writes."""
        if self._read_only:
            return None
        with self._lock:
            return self._check_file_locked()

    def _check_file_locked(self) -> str | None:
        found = _file_id(self.path)
        if found is not None and found == self._file_id:
            return None
        what = "deleted" if found is None else "replaced by another file"
        problem = f"the ledger {self.path} was {what} while gpushare-node ran"
        try:
            aside = self._rewrite_from_open_copy(replaced=found is not None)
        except (OSError, sqlite3.Error) as e:
            log.critical(
                "%s; rewriting it from the daemon's open copy failed (%s): writes go on into "
                "the lost file and are gone at the next start; make %s writable",
                problem,
                e,
                self._state_dir,
            )
            return problem
        counts = self._db.execute(
            "SELECT (SELECT count(*) FROM allocations), (SELECT count(*) FROM containers)"
        ).fetchone()
        log.critical(
            "%s; rewrote it from the daemon's open copy (%d allocations, %d registered "
            "containers)%s; do not remove state_dir while gpushare-node runs",
            problem,
            counts[0],
            counts[1],
            f"; the replacement is kept at {aside}" if aside else "",
        )
        return problem

    def _rewrite_from_open_copy(self, replaced: bool) -> str | None:
        """Copy the open (lost) ledger into a new file at ``self.path`` and switch to it.
        Returns where a replacement file was set aside, if one was."""
        os.makedirs(self._state_dir, mode=0o700, exist_ok=True)
        aside = None
        if replaced:
            aside = f"{self.path}.replaced-{int(time.time())}"
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):  # they belong to the replacement, not to us
                with contextlib.suppress(FileNotFoundError):
                    os.replace(self.path + suffix, aside + suffix)
        tmp = f"{self.path}.rewrite-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        copy = sqlite3.connect(tmp)
        try:
            self._db.backup(copy)
        finally:
            copy.close()
        os.replace(tmp, self.path)
        old, self._db = self._db, self._connect()
        with contextlib.suppress(sqlite3.Error):
            old.close()
        return aside

    def _check_integrity(self) -> None:
        result = self._db.execute("PRAGMA quick_check").fetchone()
        if not result or result[0] != "ok":
            raise LedgerError(f"the ledger {self.path} is corrupt ({result}){_RECOVERY_HINT}")

    def _check_schema_version(self) -> None:
        found = self.get_meta("schema_version")
        if found is None:
            self.created = True
            self.set_meta("schema_version", SCHEMA_VERSION)
        elif found != SCHEMA_VERSION:
            raise LedgerError(
                f"the ledger {self.path} has schema version {found}, this gpushare-node "
                f"understands {SCHEMA_VERSION}: run the gpushare-node version that wrote it"
            )

    def load(self) -> list[Allocation]:
        with self._lock:
            try:
                rows = self._db.execute(
                    "SELECT id, memory_mib, created_at, namespace, pod, container, confirmed_at"
                    " FROM allocations ORDER BY created_at, id"
                ).fetchall()
                device_rows = self._db.execute(
                    "SELECT allocation_id, kind, device_id FROM devices"
                ).fetchall()
            except sqlite3.Error as e:
                raise LedgerError(f"cannot read the ledger {self.path}: {e}") from e
        devices: dict[str, dict[ResourceKind, list[str]]] = {}
        for allocation_id, kind, device_id in device_rows:
            try:
                resource_kind = ResourceKind(kind)
            except ValueError as e:
                raise LedgerError(
                    f"the ledger {self.path} holds device {device_id} of unknown kind {kind!r}"
                ) from e
            devices.setdefault(allocation_id, {}).setdefault(resource_kind, []).append(device_id)
        allocations = []
        for id_, memory_mib, created_at, namespace, pod, container, confirmed_at in rows:
            owner = ContainerRef(namespace, pod, container) if pod is not None else None
            allocations.append(
                Allocation(
                    id=id_,
                    devices={k: tuple(sorted(v)) for k, v in devices.get(id_, {}).items()},
                    memory_mib=memory_mib,
                    created_at=created_at,
                    owner=owner,
                    confirmed_at=confirmed_at,
                )
            )
        return allocations

    def commit(self, put: Iterable[Allocation] = (), delete: Iterable[str] = ()) -> None:
        """Store new or changed allocations and drop released ones, all or nothing."""
        put, delete = list(put), list(delete)
        with self._transaction():
            for allocation_id in delete:
                self._db.execute("DELETE FROM allocations WHERE id = ?", (allocation_id,))
            for allocation in put:
                self._write_allocation(allocation)
            # All old device rows go first: a device may move between
            # two allocations of this same change.
            self._db.executemany(
                "DELETE FROM devices WHERE allocation_id = ?", [(a.id,) for a in put]
            )
            for allocation in put:
                self._write_devices(allocation)

    def _write_allocation(self, allocation: Allocation) -> None:
        self._db.execute(
            "INSERT INTO allocations (id, memory_mib, created_at, namespace, pod, container,"
            " confirmed_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(id) DO UPDATE SET memory_mib = excluded.memory_mib,"
            " namespace = excluded.namespace, pod = excluded.pod,"
            " container = excluded.container, confirmed_at = excluded.confirmed_at",
            (
                allocation.id,
                allocation.memory_mib,
                allocation.created_at,
                *_ref_columns(allocation.owner),
                allocation.confirmed_at,
            ),
        )

    def _write_devices(self, allocation: Allocation) -> None:
        self._db.executemany(
            "INSERT INTO devices (kind, device_id, allocation_id) VALUES (?, ?, ?)",
            [
                (str(kind), device_id, allocation.id)
                for kind, device_id in allocation.device_pairs()
            ],
        )

    def load_registrations(self) -> list[Registration]:
        rows = self._read(
            "SELECT id, allocation_id, cgroup_hierarchy, cgroup_path, init_pid, init_start_ticks,"
            " namespace, pod, container, registered_at FROM containers ORDER BY registered_at, id"
        )
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

    def put_registration(self, registration: Registration) -> None:
        self._write(
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
                *_ref_columns(registration.identity),
                registration.registered_at,
            ),
        )

    def delete_registration(self, container_id: str) -> None:
        self._write("DELETE FROM containers WHERE id = ?", (container_id,))

    def add_violation(self, violation: Violation, action: str, at: float) -> None:
        """Append to the violation history (bounded: the oldest rows go first)."""
        self._write(
            "INSERT INTO violations (at, kind, action, card, allocation_id, container_id,"
            " namespace, pod, container, pids, used_mib, quota_mib, detail)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                at,
                violation.kind,
                action,
                violation.card_uuid,
                violation.allocation_id,
                violation.container_id,
                *_ref_columns(violation.owner),
                ",".join(str(pid) for pid in violation.pids),
                violation.used_mib,
                violation.quota_mib,
                violation.detail,
            ),
            "DELETE FROM violations WHERE seq <= (SELECT MAX(seq) FROM violations) - ?",
            (VIOLATION_HISTORY_ROWS,),
        )

    def violations(self, limit: int = 100) -> list[dict]:
        """The newest ``limit`` violations, newest first, as plain dicts."""
        names = (
            "at", "kind", "action", "card", "allocation_id", "container_id", "namespace", "pod",
            "container", "pids", "used_mib", "quota_mib", "detail",
        )  # fmt: skip
        rows = self._read(
            f"SELECT {', '.join(names)} FROM violations ORDER BY seq DESC LIMIT ?", (limit,)
        )
        return [dict(zip(names, row, strict=True)) for row in rows]

    def violation_counts(self) -> dict[str, int]:
        """Allocation ID -> violations in the kept history."""
        rows = self._read(
            "SELECT allocation_id, COUNT(*) FROM violations"
            " WHERE allocation_id IS NOT NULL GROUP BY allocation_id"
        )
        return dict(rows)

    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._db.execute(sql, params).fetchall()
            except sqlite3.Error as e:
                cause = _cause(e, self._state_dir)
                raise LedgerError(f"cannot read the ledger {self.path}: {cause}") from e

    def _write(self, *statements) -> None:
        """Run (sql, params) pairs as one transaction."""
        with self._transaction():
            for sql, params in zip(statements[::2], statements[1::2], strict=True):
                self._db.execute(sql, params)

    @contextlib.contextmanager
    def _transaction(self):
        """One write transaction under the lock: committed whole, or rolled back."""
        with self._lock:
            self._check_file_locked()  # a lost file is rewritten before the change goes in
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield
                    self._db.execute("COMMIT")
                except BaseException:
                    self._roll_back()
                    raise
            except sqlite3.Error as e:
                cause = _cause(e, self._state_dir)
                raise LedgerError(f"cannot write the ledger {self.path}: {cause}") from e

    def _roll_back(self) -> None:
        """Undo the open transaction, if SQLite has not already (it does on SQLITE_FULL and
        I/O errors); a failed rollback must never hide the error that caused it."""
        if not self._db.in_transaction:
            return
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error:
            log.exception("rolling back a failed ledger write failed as well")

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _cause(error: sqlite3.Error, state_dir: str) -> str:
    """SQLite's message, with what to do for the causes an operator can fix."""
    text = str(error)
    code = getattr(error, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_FULL or "is full" in text:
        return (
            f"{text}: the file system of state_dir is full; free space there (nothing was written)"
        )
    if code == sqlite3.SQLITE_CORRUPT or "malformed" in text:
        # Damaged under the running daemon (truncated, overwritten): it says so at every
        # refused write, not only at the next start.
        return f"{text}: the ledger file is damaged{_RECOVERY_HINT}"
    io_error = code is not None and code & 0xFF == sqlite3.SQLITE_IOERR
    if "readonly" in text or "read-only" in text or (io_error and _read_only(state_dir)):
        return f"{text}: state_dir is read-only; make it writable (nothing was written)"
    return text


def _read_only(state_dir: str) -> bool:
    """Whether state_dir's file system refuses writes as read-only. A file system the kernel
    turned read-only under the open ledger (a disk error with ext4's errors=remount-ro)
    gives SQLite a bare I/O error, and on current kernels still shows rw in its mount
    flags: only a write tells, so one is tried (asked only after a failed write)."""
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


def _ref_columns(ref: ContainerRef | None) -> tuple[str | None, str | None, str | None]:
    """The namespace, pod and container columns of a container reference (NULLs for none)."""
    return (ref.namespace, ref.pod, ref.container) if ref else (None, None, None)


_RECOVERY_HINT = (
    "; to recover, stop gpushare-node, move the file aside (keep it for a bug report) and "
    "start again: allocations kubelet still reports are adopted from its PodResources record"
)
