"""Pins the ledger: allocations survive reopening, changes are all-or-nothing even
when the writing process is killed -9 in the middle, corruption found at start is refused
loudly; registered containers round-trip, and the violation history lists newest first and
keeps only its newest VIOLATION_HISTORY_ROWS rows; commits leave checkpoints to
check_file. A file deleted or replaced under the running daemon is rewritten from its
open copy; one damaged under it (truncated, overwritten) is kept aside and rebuilt from
what the daemon holds.

Why this module is longer than 400 lines: every way the ledger file can be lost or damaged
under the running daemon is pinned next to the others, on one fixture of a busy ledger."""

import contextlib
import dataclasses
import logging
import os
import pathlib
import resource
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading

import pytest

from nodemgr.allocation import ledger as ledger_module
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import LEDGER_FILE, Ledger
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import (
    Allocation,
    CgroupKey,
    ClaimRef,
    ClaimResult,
    ContainerRef,
    Registration,
)
from nodemgr.domain.violations import MEMORY, UNALLOCATED, Violation
from nodemgr.errors import LedgerError
from nodemgr.inventory import open_inventory
from standins.ledger_rows import allocation

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE


def test_round_trip_and_survives_reopen(tmp_path):
    ledger = Ledger(str(tmp_path))
    first = allocation(owner=ContainerRef("ns", "pod", "c"))
    ledger.commit(put=[first])
    ledger.close()
    again = Ledger(str(tmp_path))
    assert again.load() == [first]


def test_a_claims_allocation_round_trips_and_goes_with_its_allocation(tmp_path):
    """The DRA claim an allocation was made for (UID, name, results with and without a
    share ID) survives reopening, also read-only; deleting the allocation drops it."""
    ledger = Ledger(str(tmp_path))
    claim = ClaimRef(
        "uid-1",
        "ns",
        "c1",
        (
            ClaimResult("gpu", "node-a", "gpu-0", "s-1"),
            ClaimResult("gpu/x", "node-a", "gpu-1", None),
        ),
    )
    held = dataclasses.replace(allocation("ga-1"), claim=claim)
    ledger.commit(put=[held])
    ledger.close()
    assert Ledger(str(tmp_path)).load() == [held]
    assert Ledger(str(tmp_path), read_only=True).load() == [held]
    again = Ledger(str(tmp_path))
    again.commit(delete=["ga-1"])
    assert again._db.execute("SELECT count(*) FROM claims").fetchone() == (0,)


def test_the_owners_pod_uid_round_trips_and_a_changed_owner_can_drop_it(tmp_path):
    """The UID of the owner's pod survives reopening (also read-only); an update that drops
    it (kubelet's record named another pod) drops it on disk too."""
    ledger = Ledger(str(tmp_path))
    owned = dataclasses.replace(
        allocation(owner=ContainerRef("ns", "web-0", "main")), owner_uid="uid-1"
    )
    ledger.commit(put=[owned])
    ledger.close()
    assert Ledger(str(tmp_path)).load() == [owned]
    assert Ledger(str(tmp_path), read_only=True).load() == [owned]
    moved = dataclasses.replace(owned, owner=ContainerRef("ns", "web-1", "main"), owner_uid=None)
    again = Ledger(str(tmp_path))
    again.commit(put=[moved])
    again.close()
    assert Ledger(str(tmp_path)).load() == [moved]


def old_ledger(path, version: str) -> None:
    """A ledger as gpushare-node of schema ``version`` left it: version 1 without the claims
    table (DRA), 1 and 2 without the owner's pod UID column."""
    ledger = Ledger(str(path))
    ledger.commit(put=[allocation("ga-1", owner=ContainerRef("ns", "web-0", "main"))])
    if version == "1":
        ledger._db.execute("DROP TABLE claims")
    ledger._db.execute("ALTER TABLE allocations DROP COLUMN pod_uid")
    ledger.set_meta("schema_version", version)
    ledger.close()


@pytest.mark.parametrize("version", ["1", "2"])
def test_an_older_ledger_is_upgraded_and_read_only_opens_still_read_it(tmp_path, version):
    """A ledger of an older schema (1: before DRA, no claims table; 1 and 2: no owner pod
    UID) opens read-only as it is, and for writing is upgraded to the current version with
    its allocations kept (their owners' UIDs unknown), after which UIDs are kept."""
    old_ledger(tmp_path, version)
    assert [a.id for a in Ledger(str(tmp_path), read_only=True).load()] == ["ga-1"]
    upgraded = Ledger(str(tmp_path))
    assert upgraded.get_meta("schema_version") == ledger_module.SCHEMA_VERSION == "3"
    [kept] = upgraded.load()
    assert kept.id == "ga-1" and kept.owner_uid is None
    upgraded.commit(put=[dataclasses.replace(kept, owner_uid="uid-1")])
    upgraded.close()
    assert [a.owner_uid for a in Ledger(str(tmp_path)).load()] == ["uid-1"]


def test_a_newer_ledger_is_refused_naming_both_versions(tmp_path):
    """A ledger a newer gpushare-node wrote (a schema this one does not know) is not opened:
    its rows could mean more than this version reads."""
    ledger = Ledger(str(tmp_path))
    ledger.set_meta("schema_version", "4")
    ledger.close()
    with pytest.raises(LedgerError, match="schema version 4, this gpushare-node understands 3"):
        Ledger(str(tmp_path))


def test_update_and_delete_in_one_transaction(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.commit(put=[allocation("ga-1"), allocation("ga-2", units=0, percent=0)])
    changed = allocation("ga-1", units=1, percent=0)
    ledger.commit(put=[changed], delete=["ga-2"])
    assert ledger.load() == [changed]


def test_a_device_held_twice_is_refused_and_nothing_changes(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.commit(put=[allocation("ga-1")])
    with pytest.raises(LedgerError, match="UNIQUE"):
        ledger.commit(put=[allocation("ga-2", units=1, percent=0)])
    assert [a.id for a in ledger.load()] == ["ga-1"]
    # A refusal that is not damage sets nothing aside and rebuilds nothing.
    assert sorted(os.listdir(tmp_path)) == [LEDGER_FILE, LEDGER_FILE + "-shm", LEDGER_FILE + "-wal"]


def test_kill_9_in_the_middle_of_a_write_leaves_no_partial_allocation(tmp_path):
    Ledger(str(tmp_path)).commit(put=[allocation("ga-before", units=1, percent=0)])
    # A real process writes the allocation row, then is killed -9 before the
    # devices and the commit.
    script = textwrap.dedent(f"""
        import sys, time
        from nodemgr.allocation.ledger import Ledger
        from standins.ledger_rows import allocation
        ledger = Ledger({str(tmp_path)!r})
        def stall(self, allocation):
            print("row written", flush=True)
            time.sleep(60)
        Ledger._write_devices = stall
        ledger.commit(put=[allocation("ga-torn", units=4, percent=30)])
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ),
    )
    assert child.stdout.readline().strip() == "row written"
    child.send_signal(signal.SIGKILL)
    child.wait()
    survivors = Ledger(str(tmp_path)).load()
    assert [a.id for a in survivors] == ["ga-before"]
    assert survivors[0].memory_units == 1


def test_corrupt_file_is_refused_with_recovery_hint_and_left_in_place(tmp_path):
    path = tmp_path / LEDGER_FILE
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(LedgerError, match="move the file aside"):
        Ledger(str(tmp_path))
    assert path.read_bytes() == b"this is not sqlite" * 100


def test_a_state_dir_that_cannot_be_made_is_a_ledger_error(tmp_path):
    """A state_dir that cannot be created is a LedgerError naming the ledger's path."""
    (tmp_path / "a-file").write_text("")
    with pytest.raises(LedgerError, match="cannot open the ledger"):
        Ledger(str(tmp_path / "a-file" / "state"))


def test_read_only_open_does_not_create_anything(tmp_path):
    with pytest.raises(LedgerError):
        Ledger(str(tmp_path / "missing"), read_only=True)
    assert not (tmp_path / "missing").exists()


def test_meta_values_persist(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.set_meta("memory_unit_mib", "1024")
    ledger.close()
    assert Ledger(str(tmp_path)).get_meta("memory_unit_mib") == "1024"


# --- registered containers and the violation history -------------------------------------------


def registration(container_id="c1", identity=None, registered_at=2000.0):
    return Registration(
        container_id=container_id,
        allocation_id="ga-1",
        cgroup=CgroupKey("", f"/kubepods/{container_id}"),
        init_pid=4242,
        init_start_ticks=987654,
        identity=identity,
        registered_at=registered_at,
    )


def test_registrations_round_trip_survive_reopen_and_delete(tmp_path):
    """Registered containers come back in registration order after a reopen; deleting one
    that was never there is fine."""
    ledger = Ledger(str(tmp_path))
    ledger.commit(put=[allocation("ga-1")])
    with_identity = registration("c1", ContainerRef("ns", "pod", "main"), 2000.0)
    without = registration("c2", None, 2001.0)
    ledger.put_registration(without)
    ledger.put_registration(with_identity)
    assert ledger.load_registrations() == [with_identity, without]  # by registration time
    ledger.close()
    again = Ledger(str(tmp_path))
    assert again.load_registrations() == [with_identity, without]
    again.delete_registration("c1")
    again.delete_registration("never-there")  # nothing to delete is fine
    assert again.load_registrations() == [without]


def test_putting_a_registration_again_replaces_it(tmp_path):
    """Registering a container ID again replaces its row (a new allocation, a new cgroup)."""
    ledger = Ledger(str(tmp_path))
    ledger.commit(put=[allocation("ga-1"), allocation("ga-2", units=0, percent=0)])
    ledger.put_registration(registration("c1"))
    moved = Registration(
        "c1", "ga-2", CgroupKey("memory", "/other"), 7, 8, None, registered_at=3000.0
    )
    ledger.put_registration(moved)
    assert ledger.load_registrations() == [moved]


def violation(n, owner=None, kind=MEMORY):
    return Violation(
        kind=kind,
        card_uuid="GPU-a",
        pids=(100 + n, 200 + n),
        detail=f"violation {n}",
        allocation_id="ga-1",
        container_id="c1",
        owner=owner,
        used_mib=5000 + n,
        quota_mib=4096,
    )


def test_violations_are_listed_newest_first_with_every_field(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.add_violation(violation(1, ContainerRef("ns", "pod", "main")), "kill", 10.0)
    ledger.add_violation(Violation(UNALLOCATED, "GPU-b", (7,), "stray", used_mib=300), "log", 11.0)
    assert ledger.violations() == [
        {
            "at": 11.0,
            "kind": UNALLOCATED,
            "action": "log",
            "card": "GPU-b",
            "allocation_id": None,
            "container_id": None,
            "namespace": None,
            "pod": None,
            "container": None,
            "pids": "7",
            "used_mib": 300,
            "quota_mib": 0,
            "detail": "stray",
        },
        {
            "at": 10.0,
            "kind": MEMORY,
            "action": "kill",
            "card": "GPU-a",
            "allocation_id": "ga-1",
            "container_id": "c1",
            "namespace": "ns",
            "pod": "pod",
            "container": "main",
            "pids": "101,201",
            "used_mib": 5001,
            "quota_mib": 4096,
            "detail": "violation 1",
        },
    ]
    assert [v["detail"] for v in ledger.violations(limit=1)] == ["stray"]


def test_violation_history_keeps_only_the_newest_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_module, "VIOLATION_HISTORY_ROWS", 5)
    ledger = Ledger(str(tmp_path))
    for n in range(8):
        ledger.add_violation(violation(n), "kill", 100.0 + n)
    expected = [f"violation {n}" for n in (7, 6, 5, 4, 3)]
    assert [v["detail"] for v in ledger.violations(limit=100)] == expected
    ledger.close()
    assert [v["detail"] for v in Ledger(str(tmp_path)).violations()] == expected


def test_a_full_disk_is_refused_with_its_cause_and_the_ledger_recovers(tmp_path):
    """When SQLite runs out of room (a full disk; here a page limit gives the same
    SQLITE_FULL) the error names that cause, not a failed rollback, nothing half-written
    stays, and writes work again once there is room."""
    ledger = Ledger(str(tmp_path))
    ledger.commit(put=[allocation("ga-kept", units=0, percent=1)])
    pages = ledger._db.execute("PRAGMA page_count").fetchone()[0]
    ledger._db.execute(f"PRAGMA max_page_count = {pages}")
    ledger.commit(put=[])  # an empty change still fits
    with pytest.raises(LedgerError) as refused:
        ledger.commit(put=[allocation("ga-big", units=5000, percent=0)])
    assert "full" in str(refused.value) and "no transaction is active" not in str(refused.value)
    assert [a.id for a in ledger.load()] == ["ga-kept"]
    ledger._db.execute("PRAGMA max_page_count = 1073741823")
    ledger.commit(put=[allocation("ga-big", units=5000, percent=0)])
    assert sorted(a.id for a in ledger.load()) == ["ga-big", "ga-kept"]


def _reg(container_id: str, allocation_id: str) -> Registration:
    return Registration(
        container_id=container_id,
        allocation_id=allocation_id,
        cgroup=CgroupKey("", f"/kubepods/{container_id}"),
        init_pid=1234,
        init_start_ticks=99,
        identity=ContainerRef("default", "pod-a", "main"),
        registered_at=5.0,
    )


def test_commits_leave_the_checkpoint_to_check_file(tmp_path):
    """A commit never checkpoints the WAL into the main file (SQLite's automatic
    checkpoint fsyncs twice: ~5 ms on the commit that crossed 1000 pages, an Allocate
    or NodePrepareResources waiting on it); check_file, which the run loop calls every
    tick, does it from a connection of its own once CHECKPOINT_COMMITS commits piled
    up, not before; what was committed reads back all along and after a reopen."""
    state_dir = tmp_path / "state"
    ledger = Ledger(str(state_dir))
    main = state_dir / LEDGER_FILE

    def main_file():
        return main.stat().st_mtime_ns, main.stat().st_size

    before = main_file()
    for n in range(400):  # well over 1000 WAL pages
        ledger.commit(put=[allocation(f"ga-{n}", units=1, percent=0)])
        ledger.commit(delete=[f"ga-{n}"])
    ledger.commit(put=[allocation("ga-kept", units=1, percent=0)])
    assert main_file() == before
    assert ledger.check_file() is None
    checkpointed = main_file()
    assert checkpointed != before
    for n in range(ledger_module.CHECKPOINT_COMMITS - 1):
        ledger.commit(put=[allocation("ga-kept", units=1, percent=n % 2)])
    assert ledger.check_file() is None  # one commit short of a checkpoint
    assert main_file() == checkpointed
    assert [a.id for a in ledger.load()] == ["ga-kept"]
    ledger.close()
    assert [a.id for a in Ledger(str(state_dir)).load()] == ["ga-kept"]


def test_a_ledger_file_deleted_while_running_is_rewritten_at_the_next_write(tmp_path, caplog):
    """A state_dir removed under the running daemon used to go unnoticed (writes went into
    the deleted file, and the next start had nothing): the next write notices, rewrites
    the whole ledger from the daemon's open copy, says so loudly, and then commits."""
    state_dir = tmp_path / "state"
    ledger = Ledger(str(state_dir))
    ledger.commit(put=[allocation("ga-one", units=0, percent=10)])
    ledger.put_registration(_reg("c1", "ga-one"))
    for name in os.listdir(state_dir):
        os.unlink(state_dir / name)
    os.rmdir(state_dir)
    ledger.commit(put=[allocation("ga-two", units=1, percent=0)])
    assert "deleted" in caplog.text and "rewrote" in caplog.text
    ledger.close()
    reopened = Ledger(str(state_dir))
    assert sorted(a.id for a in reopened.load()) == ["ga-one", "ga-two"]
    assert [r.container_id for r in reopened.load_registrations()] == ["c1"]


def test_a_replaced_ledger_file_is_set_aside_and_rewritten_by_check_file(tmp_path, caplog):
    """A ledger file replaced while running (an old copy restored over it) is noticed by
    check_file, which the run loop calls every tick: the replacement is kept aside under
    a name that says so, and the daemon's ledger is written back in its place."""
    ledger = Ledger(str(tmp_path))
    ledger.commit(put=[allocation("ga-live", units=1, percent=0)])
    assert ledger.check_file() is None
    stale = tmp_path / "stale"
    Ledger(str(stale)).close()
    os.replace(stale / LEDGER_FILE, tmp_path / LEDGER_FILE)
    problem = ledger.check_file()
    assert problem is not None and "replaced" in problem
    assert ledger.check_file() is None  # said once; the file is ours again
    aside = [n for n in os.listdir(tmp_path) if n.startswith(LEDGER_FILE + ".replaced-")]
    assert len([n for n in aside if not n.endswith(("-wal", "-shm"))]) == 1
    ledger.close()
    assert [a.id for a in Ledger(str(tmp_path)).load()] == ["ga-live"]


# --- a ledger damaged under the running daemon -------------------------------------------------

HELD = 60  # allocations of the busy ledger: enough pages that half the file loses rows


def _held(n: int) -> Allocation:
    """Allocation n of a busy node: memory and share devices of its own, a pod of its own."""
    return Allocation(
        id=f"ga-{n:03d}",
        devices={MEM: (f"GPU-a-_-{n}",), CORE: (f"GPU-a-_-c{n}",)},
        memory_mib=1024,
        created_at=1000.0 + n,
        owner=ContainerRef("ns", f"pod-{n}", "main"),
        confirmed_at=1100.0 + n,
    )


def _checkpoint(state_dir) -> None:
    """Everything into the main file, as any checkpoint leaves it: a cut then takes committed
    rows, not pages a WAL still covers (another connection, as the fault matrix does it)."""
    with contextlib.closing(sqlite3.connect(state_dir / LEDGER_FILE)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _busy_ledger(state_dir) -> tuple[Ledger, list[Allocation], list[Registration]]:
    """A daemon's ledger with HELD allocations less one released, one changed (its
    created_at stays the first one's, as the file keeps it), a registered container on each,
    one moved and one gone, a meta key and a violation history, checkpointed; with the
    allocations and registrations a fresh reader finds in it (what a rebuild must hold)."""
    ledger = Ledger(str(state_dir))
    held = [_held(n) for n in range(HELD)]
    ledger.commit(put=held)
    for n, one in enumerate(held):
        ledger.put_registration(_reg(f"c{n:03d}", one.id))
    changed = dataclasses.replace(held[0], created_at=1.0, confirmed_at=1234.0)
    ledger.commit(put=[changed], delete=[held[1].id])
    ledger.put_registration(_reg("c002", held[3].id))
    ledger.delete_registration("c001")
    ledger.set_meta("memory_unit_mib", "1024")
    for n in range(20):
        ledger.add_violation(violation(n), "kill", 100.0 + n)
    _checkpoint(state_dir)
    allocations, registrations, reader = _on_disk(state_dir)
    reader.close()
    assert allocations[0].created_at == held[0].created_at and len(allocations) == HELD - 1
    return ledger, allocations, registrations


def _cut_to_half(state_dir) -> int:
    path = state_dir / LEDGER_FILE
    half = path.stat().st_size // 2
    os.truncate(path, half)
    return half


def _damaged_copies(state_dir) -> list[str]:
    """The damaged ledger files kept aside (their -wal and -shm apart)."""
    return [
        name
        for name in sorted(os.listdir(state_dir))
        if name.startswith(LEDGER_FILE + ".damaged-") and not name.endswith(("-wal", "-shm"))
    ]


def _on_disk(state_dir) -> tuple[list[Allocation], list[Registration], Ledger]:
    """What a fresh reader (nodemgr, the next start) finds in the file."""
    reader = Ledger(str(state_dir), read_only=True)
    return reader.load(), reader.load_registrations(), reader


def test_a_ledger_truncated_under_the_daemon_is_rebuilt_from_memory_at_the_next_write(
    tmp_path, caplog
):
    """The file cut to half under the running daemon used to refuse every write that met a
    lost page until an operator stopped the daemon: now the next write keeps the damaged
    file aside as found, rebuilds the ledger from what the daemon holds, says so at CRITICAL
    with the counts and what is lost for good, and commits; a fresh reader finds every
    allocation, registration and meta key, and no violation history (it was only in the
    file)."""
    state = tmp_path / "state"
    ledger, held, registrations = _busy_ledger(state)
    half = _cut_to_half(state)
    ledger.commit(put=[_held(HELD)])
    [damaged] = _damaged_copies(state)
    assert (state / damaged).stat().st_size == half  # kept as it was found
    [said] = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert (
        f"rebuilt it from the daemon's memory ({HELD - 1} allocations, {HELD - 1} registered"
        in said
    )
    assert str(state / damaged) in said and "violation history" in said
    allocations, on_disk_registrations, reader = _on_disk(state)
    assert allocations == [*held, _held(HELD)]
    assert on_disk_registrations == registrations
    assert reader.get_meta("memory_unit_mib") == "1024"
    assert reader.violations() == []
    ledger.delete_registration("c000")  # and it writes on into the new file
    assert [r.container_id for r in reader.load_registrations()] == [
        r.container_id for r in registrations[1:]
    ]


def test_a_ledger_overwritten_under_the_daemon_is_rebuilt_when_a_write_finds_it_malformed(
    tmp_path, caplog
):
    """Garbage over every page but the first (its size unchanged: only SQLite can tell): the
    write that meets it ("database disk image is malformed") is not refused but retried once
    on the ledger rebuilt from memory, and commits."""
    state = tmp_path / "state"
    ledger, held, registrations = _busy_ledger(state)
    path = state / LEDGER_FILE
    page_size = ledger._db.execute("PRAGMA page_size").fetchone()[0]
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(page_size)  # page 1 (the header and the schema) stays readable
        f.write(b"\xa5" * (size - page_size))
    late = _reg("c-late", "ga-000")
    ledger.put_registration(late)
    assert len(_damaged_copies(state)) == 1
    assert "malformed" in caplog.text and "rebuilt it from the daemon's memory" in caplog.text
    allocations, on_disk_registrations, _ = _on_disk(state)
    assert allocations == held
    assert on_disk_registrations == sorted([*registrations, late], key=lambda r: r.container_id)


def test_a_rebuild_that_fails_refuses_the_write_with_its_cause_and_loses_nothing(tmp_path):
    """When the rebuilt ledger cannot be written either (a file size limit of one page: no
    room for a new file, as on a full disk), the write is refused naming the damage, why the
    rebuild failed and how to recover; the damaged file stays in place and nothing half-built
    is left; the daemon's memory is intact, so the next write, once there is room, rebuilds
    it with everything."""
    state = tmp_path / "state"
    ledger, held, registrations = _busy_ledger(state)
    _cut_to_half(state)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(LedgerError) as refused:
            ledger.commit(put=[_held(HELD)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(refused.value)
    assert "damaged" in message and "rebuilding it from the daemon's memory failed" in message
    assert "disk I/O error" in message and "move the file aside" in message
    assert sorted(os.listdir(state)) == [LEDGER_FILE, LEDGER_FILE + "-shm", LEDGER_FILE + "-wal"]
    ledger.commit(put=[_held(HELD + 1)])
    assert len(_damaged_copies(state)) == 1
    allocations, on_disk_registrations, _ = _on_disk(state)
    assert allocations == [*held, _held(HELD + 1)]  # the refused one is not there
    assert on_disk_registrations == registrations


def test_check_file_rebuilds_a_truncated_ledger_without_waiting_for_a_write(tmp_path):
    """The run loop's check (every tick) notices a cut the moment after a checkpoint, which no
    stat of the daemon's saw (the file is shorter than the database size its own header
    records), confirms the damage with a fresh reader (the daemon's page cache can hide it)
    and rebuilds at once: a daemon restarted before its next write finds its ledger whole
    instead of refusing to start."""
    state = tmp_path / "state"
    ledger, held, registrations = _busy_ledger(state)
    _cut_to_half(state)
    problem = ledger.check_file()
    assert problem is not None and "damaged" in problem and "shorter than its header" in problem
    assert ledger.check_file() is None  # said once: the file is whole again
    ledger.close()
    restarted = Ledger(str(state))  # start-up's integrity check passes
    assert restarted.load() == held
    assert restarted.load_registrations() == registrations


def test_a_write_that_meets_no_damaged_page_still_rebuilds_a_cut_file_first(tmp_path):
    """A write whose pages the cut spared (a meta key: the first table) would go through into
    the damaged file, which then refuses the next start: the file shorter than its own
    header says (read at every write) makes that write rebuild it first."""
    state = tmp_path / "state"
    ledger, held, registrations = _busy_ledger(state)
    _cut_to_half(state)
    ledger.set_meta("memory_unit_mib", "2048")
    assert len(_damaged_copies(state)) == 1
    allocations, on_disk_registrations, reader = _on_disk(state)
    assert (allocations, on_disk_registrations) == (held, registrations)
    assert reader.get_meta("memory_unit_mib") == "2048"


def test_an_allocate_meeting_a_damaged_ledger_commits_and_the_file_holds_what_memory_holds(
    settings,
):
    """Allocate commits while it holds the allocator's lock, so the rebuild must not ask the
    allocator for its state (it would wait on that lock for ever): it is admitted, and the
    rebuilt file holds exactly the allocator's allocations."""
    ledger = Ledger(settings.state_dir)
    allocator = Allocator(settings, open_inventory(settings.gpus).cards(), ledger)

    def admit_one() -> None:
        for kind, size in ((MEM, 1), (CORE, 5)):
            held = {key for a in allocator.allocations() for key in a.device_pairs()}
            free = [d.id for d in allocator.devices(kind) if (kind, d.id) not in held]
            allocator.allocate(kind, allocator.preferred(kind, free, [], size))

    for _ in range(12):
        admit_one()
    state = pathlib.Path(settings.state_dir)
    _checkpoint(state)
    _cut_to_half(state)
    failed: list[BaseException] = []

    def admit_recording_failure() -> None:
        try:
            admit_one()
        except BaseException as e:  # re-raised below, in the test's thread
            failed.append(e)

    worker = threading.Thread(target=admit_recording_failure, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "Allocate hangs: the rebuild waits on the allocator's lock"
    assert not failed, failed
    assert len(_damaged_copies(state)) == 1
    allocations, _, _ = _on_disk(state)
    assert allocations == allocator.allocations() and len(allocations) == 13
