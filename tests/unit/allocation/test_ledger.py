"""Pins the ledger: allocations survive reopening, changes are all-or-nothing even
when the writing process is killed -9 in the middle, corruption is refused loudly;
registered containers round-trip, and the violation history lists newest first and
keeps only its newest VIOLATION_HISTORY_ROWS rows."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from nodemgr.allocation import ledger as ledger_module
from nodemgr.allocation.ledger import LEDGER_FILE, Ledger
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import CgroupKey, ContainerRef, Registration
from nodemgr.domain.violations import MEMORY, UNALLOCATED, Violation
from nodemgr.errors import LedgerError
from tests.harness.ledger_rows import allocation

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE


def test_round_trip_and_survives_reopen(tmp_path):
    ledger = Ledger(str(tmp_path))
    first = allocation(owner=ContainerRef("ns", "pod", "c"))
    ledger.commit(put=[first])
    ledger.close()
    again = Ledger(str(tmp_path))
    assert again.load() == [first]


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


def test_kill_9_in_the_middle_of_a_write_leaves_no_partial_allocation(tmp_path):
    Ledger(str(tmp_path)).commit(put=[allocation("ga-before", units=1, percent=0)])
    # A real process writes the allocation row, then is killed -9 before the
    # devices and the commit.
    script = textwrap.dedent(f"""
        import sys, time
        from nodemgr.allocation.ledger import Ledger
        from tests.harness.ledger_rows import allocation
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
