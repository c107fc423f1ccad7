"""The durable ledger: allocations, registered containers and the violation history.

Every change is one transaction, committed before Allocate answers kubelet, so a kill
of the daemon at any instant leaves the whole change or none. WAL with
``synchronous=NORMAL`` (an fsync per commit cost more than the rest of Allocate): a
commit survives any crash of the daemon; only a power loss or kernel crash takes back
the last ones, and then every container is gone too and what was lost is recovered
(kubelet's record adopted; a container restarted with kubelet's cached env tied to its
pod's allocation, nodemgr.domain.podtie).
Nor does a commit checkpoint the WAL into the main file: SQLite's automatic checkpoint, at
1000 pages, fsyncs twice (~5 ms on whichever Allocate or NodePrepareResources crossed the
mark). Once ``CHECKPOINT_COMMITS`` commits piled up, ``check_file``, which the run loop
calls every tick, checkpoints them, PASSIVE, from a connection of its own and outside the
writes' lock, so commits go on meanwhile. As rarely as SQLite would, not at every tick: a
checkpoint restarts the WAL, and commits made just after one were lost when the file
system turned read-only under the daemon right then (the fault matrix, tests/faults). The
automatic checkpoint stays as a backstop far above that (``BACKSTOP_CHECKPOINT_PAGES``),
for a ledger no run loop ticks.

A corrupt ledger stops start-up saying how to recover; a write refused because
state_dir is full or read-only says so. While the daemon runs, ``check_file`` (every
tick and before every write: a stat, the header read when the file changed) keeps the
file whole, saying what it did at CRITICAL:

- deleted or replaced (``rm -rf`` of state_dir, an old copy restored): the open
  connection still reads the lost file, so it is copied to the path (a replacement
  kept as ``ledger.sqlite.replaced-<time>``);
- damaged (truncated, overwritten): found when a write meets a damaged page or the
  file is shorter than its header says (SQLite never shrinks it), confirmed by a
  fresh reader. The ledger is rebuilt from ``_Committed``, the image in memory of
  everything committed, kept here because Allocate commits under the allocator's
  lock, so asking the allocator would deadlock. The damaged file is kept as
  ``ledger.sqlite.damaged-<time>``; the violation history, only on file, is lost;
  the write is tried once more, and refused naming both failures if it fails again.

The image's allocations are the allocation state itself, held once: the allocator
reads them under its own lock, under which every commit is made.

What it must not do: decide anything; it stores what the allocator and the
enforcement say; call back into the allocator or the registry.

Longer than 400 lines: every loss or damage of the file is handled under the writes' lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from nodemgr.allocation.ledgerfile import (
    POD_UID_COLUMN,
    RECOVERY_HINT,
    SCHEMA,
    FileHandle,
    error_cause,
    has_pod_uid_column,
    is_damage,
    put_allocation,
    put_devices,
    put_registration,
    read_allocations,
    read_registrations,
    ref_columns,
    remove,
    stat,
    unused_name,
    write_new_ledger,
)
from nodemgr.domain.model import Allocation, Registration
from nodemgr.domain.violations import Violation
from nodemgr.errors import LedgerError

SCHEMA_VERSION = "3"
# Opened and upgraded: 1 lacks the claims table, 1 and 2 the owner's pod UID column
# (their owner UIDs are unknown). A version newer than the code's is refused: code for
# 1 would release claims' allocations, code for 2 keep a UID kubelet contradicts.
UPGRADABLE_VERSIONS = ("1", "2")
LEDGER_FILE = "ledger.sqlite"

VIOLATION_HISTORY_ROWS = 10000
# Commits after which check_file checkpoints the WAL (a few pages each: about SQLite's
# own 1000 pages), and WAL pages after which a commit does it by itself (SQLite's
# default is 1000): only when check_file has not (module docstring).
CHECKPOINT_COMMITS = 200
BACKSTOP_CHECKPOINT_PAGES = 20000

log = logging.getLogger(__name__)


@dataclass
class _Committed:
    """What this daemon committed, as the file must hold it; changed only under the
    ledger's lock, after a commit went through."""

    allocations: dict[str, Allocation] = field(default_factory=dict)
    registrations: dict[str, Registration] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)

    def committed(self, put: list[Allocation], delete: list[str]) -> None:
        """As ``Ledger.commit``'s SQL does: deletes first; an update keeps created_at."""
        for allocation_id in delete:
            self.allocations.pop(allocation_id, None)
        for allocation in put:
            old = self.allocations.get(allocation.id)
            if old is not None and old.created_at != allocation.created_at:
                allocation = replace(allocation, created_at=old.created_at)
            self.allocations[allocation.id] = allocation


class Ledger:
    """Allocations on disk. Thread-safe; every method is one short transaction."""

    def __init__(self, state_dir: str, *, read_only: bool = False):
        self.path = os.path.join(state_dir, LEDGER_FILE)
        self._state_dir = state_dir
        self._read_only = read_only
        self._lock = threading.Lock()
        # The checkpoints' connection and lock. Lock order: self._lock, then this one;
        # a checkpoint holds only this one, so commits go on while it runs.
        self._checkpoint_lock = threading.Lock()
        self._checkpointer: sqlite3.Connection | None = None
        self._commits = 0  # since the last checkpoint
        self._file: FileHandle | None = None  # None: read-only
        # (size, mtime) last found whole at: unchanged, not read again.
        self._whole_at: tuple[int, int] | None = None
        # This open made the ledger (a first start, or one lost).
        self.created = False
        self._committed = _Committed()
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
                self._db.executescript(SCHEMA)
                self._check_schema_version()
                self._committed = _Committed(
                    {a.id: a for a in read_allocations(self._db, self.path)},
                    {r.container_id: r for r in read_registrations(self._db)},
                    dict(self._db.execute("SELECT key, value FROM meta").fetchall()),
                )
        except sqlite3.Error as e:
            raise LedgerError(f"cannot open the ledger {self.path}: {e}{RECOVERY_HINT}") from e
        except OSError as e:  # state_dir cannot be made: a file in the path, no permission
            raise LedgerError(
                f"cannot open the ledger {self.path}: cannot create its directory "
                f"{state_dir}: {e.strerror or e}; check state_dir in the config"
            ) from e

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # see the module docstring
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=5000")
        db.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_CHECKPOINT_PAGES}")
        self._file = FileHandle(self.path)
        return db

    def check_file(self) -> str | None:
        """Why the ledger file had to be rewritten or rebuilt just now; None when it is
        still this daemon's file, whole."""
        if self._read_only:
            return None
        with self._lock:
            try:
                problem = self._check_file_locked()
            except LedgerError as e:  # logged at CRITICAL; tried again at the next check
                return str(e)
            checkpointer = self._due_checkpointer() if problem is None else None
        if checkpointer is not None:
            self._checkpoint(checkpointer)
        return problem

    def _due_checkpointer(self) -> sqlite3.Connection | None:
        """Under the lock, the file just found to be ours and whole: the connection to
        checkpoint it with once CHECKPOINT_COMMITS commits piled up (opened now, on this
        file, if there is none)."""
        if self._commits < CHECKPOINT_COMMITS:
            return None
        with self._checkpoint_lock:
            if self._checkpointer is None:
                try:
                    db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                    db.execute("SELECT count(*) FROM meta").fetchone()  # opens the file now
                except sqlite3.Error as e:  # tried again at the next tick
                    log.warning("cannot open the ledger %s to checkpoint it: %s", self.path, e)
                    return None
                self._checkpointer = db
            self._commits = 0
            return self._checkpointer

    def _checkpoint(self, db: sqlite3.Connection) -> None:
        """Copy the WAL's commits into the main file, without the writes' lock: PASSIVE,
        so a commit meanwhile is not waited for (it goes with the next checkpoint)."""
        with self._checkpoint_lock:
            if db is not self._checkpointer:  # the file was switched meanwhile
                return
            try:
                db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error as e:  # the commits stay in the WAL, whole; next tick
                log.warning("checkpointing the ledger %s failed: %s", self.path, e)
                self._commits = CHECKPOINT_COMMITS
                self._close_checkpointer_locked()

    def _close_checkpointer(self) -> None:
        """Before the file is moved, rewritten or closed: no checkpoint runs or starts on
        it any more (a new one opens on the file then at the path)."""
        with self._checkpoint_lock:
            self._close_checkpointer_locked()

    def _close_checkpointer_locked(self) -> None:
        db, self._checkpointer = self._checkpointer, None
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()

    def _check_file_locked(self) -> str | None:
        """As ``check_file``; LedgerError when the file is damaged and could not be
        rebuilt (a write must not go into it)."""
        if self._file is None:
            return None
        info = stat(self.path)
        found = (info.st_dev, info.st_ino) if info is not None else None
        if info is None or found != self._file.file_id:
            return self._rewrite_lost_file(replaced=found is not None)
        seen = (info.st_size, info.st_mtime_ns)
        if seen == self._whole_at:
            return None
        if not self._file.cut_short(info.st_size):
            self._whole_at = seen
            return None
        try:
            damage = self._damage_on_disk()
        except sqlite3.Error as e:  # cannot tell now: asked again at the next check
            log.warning("the ledger %s looks cut short; checking it failed: %s", self.path, e)
            return None
        if damage is None:  # shorter, yet whole: what was cut is still in the WAL
            self._whole_at = seen
            return None
        cut = f"{info.st_size} bytes, shorter than its header says; {damage}"
        self._rebuild_locked(cut)
        return f"the ledger {self.path} was damaged under gpushare-node ({cut}); rebuilt"

    def _rewrite_lost_file(self, replaced: bool) -> str:
        what = "replaced by another file" if replaced else "deleted"
        problem = f"the ledger {self.path} was {what} while gpushare-node ran"
        try:
            aside = self._rewrite_from_open_copy(replaced)
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
        """Copy the open (lost) ledger to ``self.path`` and switch to it; where a
        replacement file was set aside, if one was."""
        self._close_checkpointer()
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
        self._switch_to_new_file()
        return aside

    def _switch_to_new_file(self) -> None:
        """Connect to the file now at ``self.path``, then close the old connection: its
        file is no longer there, so SQLite neither checkpoints into it nor deletes the
        new file's -wal or -shm."""
        old, old_file = self._db, self._file
        self._db = self._connect()
        with contextlib.suppress(sqlite3.Error):
            old.close()
        if old_file is not None:
            old_file.close()  # after the connection: no lock of SQLite's is dropped

    def _damage_on_disk(self) -> str | None:
        """What a fresh reader (this connection's cache may hold pages the file lost) finds
        wrong with the file; None when whole; sqlite3.Error when it cannot tell."""
        try:
            uri = f"file:{self.path}?mode=ro"
            with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
                rows = db.execute("PRAGMA quick_check").fetchall()
        except sqlite3.Error as e:
            if is_damage(e):
                return str(e)
            raise
        problems = [str(row[0]) for row in rows if row[0] != "ok"]
        return "; ".join(problems[:3]) or None

    def _rebuild_locked(self, damage: str) -> None:
        """Keep the damaged file aside and put a ledger rebuilt from memory in its place
        (under the lock)."""
        try:
            aside = self._swap_in_rebuilt()
        except (OSError, sqlite3.Error) as e:
            why = error_cause(e, self._state_dir) if isinstance(e, sqlite3.Error) else str(e)
            message = (
                f"{damage}: the ledger file is damaged, and rebuilding it from the daemon's "
                f"memory failed ({why}); nothing was written; the daemon still holds every "
                f"allocation and rebuilds the file at the next write{RECOVERY_HINT}"
            )
            log.critical("the ledger %s: %s", self.path, message)
            raise LedgerError(f"cannot write the ledger {self.path}: {message}") from e
        committed = self._committed
        log.critical(
            "the ledger %s was damaged under gpushare-node (%s); rebuilt it from the daemon's "
            "memory (%d allocations, %d registered containers, %d meta keys); the damaged "
            "file is kept at %s for a bug report (gpushare-node never deletes it); lost for "
            "good: the violation history, which only the file held",
            self.path,
            damage,
            len(committed.allocations),
            len(committed.registrations),
            len(committed.meta),
            aside,
        )

    def _swap_in_rebuilt(self) -> str:
        """Write the ledger from memory beside the damaged one, then swap them, moving
        nothing unless the new file was written whole; where the damaged file is kept."""
        self._close_checkpointer()
        tmp = f"{self.path}.rebuild-{os.getpid()}"
        remove(tmp, tmp + "-journal")
        try:
            write_new_ledger(
                tmp,
                self._committed.meta,
                self._committed.allocations.values(),
                self._committed.registrations.values(),
            )
        except BaseException:
            remove(tmp, tmp + "-journal")
            raise
        aside = unused_name(f"{self.path}.damaged-{int(time.time())}")
        os.replace(self.path, aside)
        for suffix in ("-wal", "-shm"):  # the damaged file's: never replayed into the new one
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path + suffix, aside + suffix)
        os.replace(tmp, self.path)
        self._switch_to_new_file()
        return aside

    def _check_integrity(self) -> None:
        result = self._db.execute("PRAGMA quick_check").fetchone()
        if not result or result[0] != "ok":
            raise LedgerError(f"the ledger {self.path} is corrupt ({result}){RECOVERY_HINT}")

    def _check_schema_version(self) -> None:
        found = self.get_meta("schema_version")
        if found is None:
            self.created = True
            self.set_meta("schema_version", SCHEMA_VERSION)
        elif found in UPGRADABLE_VERSIONS:
            statements: list = []
            if not has_pod_uid_column(self._db):
                statements += [POD_UID_COLUMN, ()]
            self._write(
                *statements,
                "UPDATE meta SET value = ? WHERE key = 'schema_version'",
                (SCHEMA_VERSION,),
                then=lambda: self._committed.meta.__setitem__("schema_version", SCHEMA_VERSION),
            )
            log.info("the ledger %s: schema %s upgraded to %s", self.path, found, SCHEMA_VERSION)
        elif found != SCHEMA_VERSION:
            raise LedgerError(
                f"the ledger {self.path} has schema version {found}, this gpushare-node "
                f"understands {SCHEMA_VERSION}: run the gpushare-node version that wrote it"
            )

    @property
    def allocations(self) -> Mapping[str, Allocation]:
        """The committed allocations by ID, read-only and live: the daemon's one copy.
        Changed only by ``commit``, under the allocator's lock. Empty for a read-only
        ledger (read ``load``)."""
        return MappingProxyType(self._committed.allocations)

    def load(self) -> list[Allocation]:
        with self._lock:
            try:
                return read_allocations(self._db, self.path)
            except sqlite3.Error as e:
                raise LedgerError(f"cannot read the ledger {self.path}: {e}") from e

    def commit(self, put: Iterable[Allocation] = (), delete: Iterable[str] = ()) -> None:
        """All or nothing."""
        put, delete = list(put), list(delete)

        def write() -> None:
            for allocation_id in delete:
                self._db.execute("DELETE FROM allocations WHERE id = ?", (allocation_id,))
            for allocation in put:
                put_allocation(self._db, allocation)
            # All old device rows go first: a device may move between
            # two allocations of this same change.
            self._db.executemany(
                "DELETE FROM devices WHERE allocation_id = ?", [(a.id,) for a in put]
            )
            for allocation in put:
                self._write_devices(allocation)

        self._write_through(write, lambda: self._committed.committed(put, delete))

    def _write_devices(self, allocation: Allocation) -> None:
        put_devices(self._db, allocation)

    def load_registrations(self) -> list[Registration]:
        with self._lock:
            try:
                return read_registrations(self._db)
            except sqlite3.Error as e:
                cause = error_cause(e, self._state_dir)
                raise LedgerError(f"cannot read the ledger {self.path}: {cause}") from e

    def put_registration(self, registration: Registration) -> None:
        def remember() -> None:
            self._committed.registrations[registration.container_id] = registration

        self._write_through(lambda: put_registration(self._db, registration), remember)

    def delete_registration(self, container_id: str) -> None:
        self._write(
            "DELETE FROM containers WHERE id = ?",
            (container_id,),
            then=lambda: self._committed.registrations.pop(container_id, None),
        )

    def add_violation(self, violation: Violation, action: str, at: float) -> None:
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
                *ref_columns(violation.owner),
                ",".join(str(pid) for pid in violation.pids),
                violation.used_mib,
                violation.quota_mib,
                violation.detail,
            ),
            "DELETE FROM violations WHERE seq <= (SELECT MAX(seq) FROM violations) - ?",
            (VIOLATION_HISTORY_ROWS,),
        )

    def violations(self, limit: int = 100) -> list[dict]:
        names = (
            "at", "kind", "action", "card", "allocation_id", "container_id", "namespace", "pod",
            "container", "pids", "used_mib", "quota_mib", "detail",
        )  # fmt: skip
        rows = self._read(
            f"SELECT {', '.join(names)} FROM violations ORDER BY seq DESC LIMIT ?", (limit,)
        )
        return [dict(zip(names, row, strict=True)) for row in rows]

    def violation_counts(self) -> dict[str, int]:
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
                cause = error_cause(e, self._state_dir)
                raise LedgerError(f"cannot read the ledger {self.path}: {cause}") from e

    def _write(self, *statements, then: Callable[[], object] | None = None) -> None:

        def run() -> None:
            for sql, params in zip(statements[::2], statements[1::2], strict=True):
                self._db.execute(sql, params)

        self._write_through(run, then)

    def _write_through(self, work: Callable[[], None], then: Callable[[], object] | None) -> None:
        """``work`` as one transaction under the lock, then ``then``; a file found damaged
        is rebuilt and ``work`` tried once more."""
        with self._lock:
            self._check_file_locked()  # a lost or cut file is replaced before the change
            try:
                self._attempt(work)
            except sqlite3.Error as e:
                if not is_damage(e):
                    cause = error_cause(e, self._state_dir)
                    raise LedgerError(f"cannot write the ledger {self.path}: {cause}") from e
                self._rebuild_locked(str(e))
                try:
                    self._attempt(work)
                except sqlite3.Error as again:
                    cause = error_cause(again, self._state_dir)
                    raise LedgerError(
                        f"cannot write the ledger {self.path}: {cause} (on the file rebuilt "
                        f"from memory just now, after {e})"
                    ) from again
            self._commits += 1
            if then is not None:
                then()

    def _attempt(self, work: Callable[[], None]) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            work()
            self._db.execute("COMMIT")
        except BaseException:
            self._roll_back()
            raise

    def _roll_back(self) -> None:
        """SQLite rolls back itself on SQLITE_FULL and I/O errors; a failed rollback must
        never hide the error that caused it."""
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
        self._write(
            "INSERT INTO meta (key, value) VALUES (?, ?)"
            " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
            then=lambda: self._committed.meta.__setitem__(key, value),
        )

    def close(self) -> None:
        with self._lock:
            self._close_checkpointer()  # first: the writer's close is the last, and cleans up
            self._db.close()
            if self._file is not None:
                self._file.close()
