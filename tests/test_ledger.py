"""Pins the ledger: allocations survive reopening, changes are all-or-nothing even
when the writing process is killed -9 in the middle, corruption is refused loudly."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from nodemgr.deviceids import ResourceKind
from nodemgr.errors import LedgerError
from nodemgr.ledger import LEDGER_FILE, Ledger
from nodemgr.model import Allocation, ContainerRef

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE


def allocation(id_="ga-1", units=2, percent=3, owner=None):
    devices = {
        MEM: tuple(f"GPU-a-_-{j}" for j in range(units)),
        CORE: tuple(f"GPU-a-_-c{j}" for j in range(percent)),
    }
    return Allocation(
        id=id_,
        devices={kind: ids for kind, ids in devices.items() if ids},
        memory_mib=units * 1024,
        created_at=1000.0,
        owner=owner,
    )


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
        from nodemgr.ledger import Ledger
        from tests.test_ledger import allocation
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
        cwd=os.path.dirname(os.path.dirname(__file__)),
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


def test_read_only_open_does_not_create_anything(tmp_path):
    with pytest.raises(LedgerError):
        Ledger(str(tmp_path / "missing"), read_only=True)
    assert not (tmp_path / "missing").exists()


def test_meta_values_persist(tmp_path):
    ledger = Ledger(str(tmp_path))
    ledger.set_meta("memory_unit_mib", "1024")
    ledger.close()
    assert Ledger(str(tmp_path)).get_meta("memory_unit_mib") == "1024"
