"""Pins nodemgr.allocation.recovery, a lost ledger taken back at start: the running
containers' registrations (read from their cgroup marks) are stored again and kubelet's
record is adopted with their old allocation IDs; a ledger that was not made at this start
is left alone, a container whose allocation kubelet does not give back is not recovered,
and when kubelet cannot be read the old IDs wait for the first reconcile."""

import os

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.allocation.recovery import recover_registrations
from nodemgr.domain.deviceids import ResourceKind, card_device_ids
from nodemgr.domain.model import CgroupKey, ContainerRef, Registration
from nodemgr.errors import GpushareError
from nodemgr.inventory import open_inventory
from standins.cards import GPU0, simulated_settings

POD_A = ContainerRef("default", "a", "main")
POD_B = ContainerRef("default", "b", "main")
MEM_NAME = "aliyun.com/gpu-mem"


def marked(container_id, allocation_id, identity):
    return Registration(
        container_id=container_id,
        allocation_id=allocation_id,
        cgroup=CgroupKey("memory", f"/kubepods/{container_id}"),
        init_pid=os.getpid(),
        init_start_ticks=1,
        identity=identity,
        registered_at=1.0,
    )


def record_of(ref, units, start=0):
    ids = card_device_ids(ResourceKind.MEMORY, GPU0, 30)[start : start + units]
    return {ref: {MEM_NAME: ids}}


def open_node(tmp_path):
    settings = simulated_settings(str(tmp_path))
    cards = open_inventory(settings.gpus).cards()
    ledger = Ledger(settings.state_dir)
    return ledger, Allocator(settings, cards, ledger)


def test_a_new_ledger_takes_back_registrations_and_old_allocation_ids(tmp_path):
    """Two containers carry marks; kubelet reports both pods' devices: each adopted
    allocation has its container's old ID, and both registrations are in the ledger."""
    ledger, allocator = open_node(tmp_path)
    marks = [marked("c-a", "ga-old-a", POD_A), marked("c-b", "ga-old-b", POD_B)]
    record = {**record_of(POD_A, 2), **record_of(POD_B, 1, start=2)}
    recovered = recover_registrations(ledger, allocator, lambda: marks, lambda: record)
    assert sorted(r.container_id for r in recovered) == ["c-a", "c-b"]
    assert {a.owner.pod: a.id for a in allocator.allocations()} == {
        "a": "ga-old-a",
        "b": "ga-old-b",
    }
    assert sorted(r.container_id for r in ledger.load_registrations()) == ["c-a", "c-b"]


def test_the_recovery_says_into_which_ledger(tmp_path, caplog):
    """The line saying how many registrations were taken back names the ledger they went
    into: on a machine running several daemons (tests), each start's line is its own."""
    ledger, allocator = open_node(tmp_path)
    marks = [marked("c-a", "ga-old-a", POD_A)]
    with caplog.at_level("WARNING", logger="nodemgr.allocation.recovery"):
        recover_registrations(ledger, allocator, lambda: marks, lambda: record_of(POD_A, 2))
    assert (
        f"recovered 1 of 1 container registrations from their cgroups into the ledger "
        f"{ledger.path}" in caplog.text
    )


def test_a_ledger_that_was_already_there_is_left_alone(tmp_path):
    """Only a ledger made at this start is recovered: marks are not even read otherwise."""
    Ledger(simulated_settings(str(tmp_path)).state_dir).close()
    ledger, allocator = open_node(tmp_path)

    def marks():
        raise AssertionError("marks read for a ledger that was not lost")

    assert recover_registrations(ledger, allocator, marks, dict) == []


def test_a_container_whose_allocation_kubelet_does_not_report_is_not_recovered(tmp_path):
    """A mark of a pod kubelet no longer gives devices to is dropped (its pod is gone)."""
    ledger, allocator = open_node(tmp_path)
    marks = [marked("c-a", "ga-old-a", POD_A), marked("c-gone", "ga-gone", POD_B)]
    recovered = recover_registrations(ledger, allocator, lambda: marks, lambda: record_of(POD_A, 2))
    assert [r.container_id for r in recovered] == ["c-a"]


def test_without_kubelet_the_old_ids_wait_for_the_first_reconcile(tmp_path):
    """kubelet unreadable at start: registrations are stored and the first reconcile
    adopts kubelet's record with the old IDs."""
    ledger, allocator = open_node(tmp_path)

    def down():
        raise GpushareError("kubelet is not answering")

    marks = [marked("c-a", "ga-old-a", POD_A)]
    recovered = recover_registrations(ledger, allocator, lambda: marks, down)
    assert [r.container_id for r in recovered] == ["c-a"]
    allocator.reconcile(record_of(POD_A, 2))
    assert [a.id for a in allocator.allocations()] == ["ga-old-a"]
    allocator.reconcile({**record_of(POD_A, 2), **record_of(POD_B, 1, start=5)})
    assert [a.id for a in allocator.allocations() if a.owner == POD_B] != ["ga-old-a"]
