"""Pins nodemgr.allocation.usage: CardUsage keeps per-card totals that add and remove
exactly (memory units, share, shared/whole counts, which allocation holds each device);
a removal never forgets a device another allocation took over; ``loads`` gives each
card's room as placement sees it (kubelet's free IDs are the truth for the resource
asked, a card given out whole is unavailable, a card problem shows, room never below
zero); ``take_over_devices`` lets kubelet's choice win over stale holders."""

import logging
from collections import Counter

import pytest

from nodemgr.allocation import usage
from nodemgr.allocation.usage import CardUsage, single_request, take_over_devices
from nodemgr.domain.deviceids import ResourceKind, core_device_id, memory_device_id
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.placement import SharedRequest
from nodemgr.inventory import Card

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE
CARDS = [Card(0, "GPU-0", "Tesla T4", 15360), Card(1, "GPU-1", "A100", 40960)]
UNITS = {"GPU-0": 15, "GPU-1": 40}


def shared(id_, card="GPU-0", units=(), percents=(), owner=None):
    devices = {}
    if units:
        devices[MEM] = tuple(memory_device_id(card, j) for j in units)
    if percents:
        devices[CORE] = tuple(core_device_id(card, j) for j in percents)
    return Allocation(id_, devices, len(units) * 1024, 1000.0, owner=owner)


def whole(id_, *cards):
    return Allocation(id_, {WHOLE: tuple(cards)}, 0, 1000.0)


def test_add_then_remove_restores_every_total():
    """Counting an allocation in and out leaves nothing behind."""
    counts = CardUsage()
    a = shared("ga-1", units=range(4), percents=range(30))
    counts.add(a)
    assert (counts.memory_units["GPU-0"], counts.core_percent["GPU-0"]) == (4, 30)
    assert counts.shared_allocations["GPU-0"] == 1
    assert counts.holders[(MEM, memory_device_id("GPU-0", 3))] == "ga-1"
    assert len(counts.holders) == 34
    counts.add(a, -1)
    assert counts.memory_units["GPU-0"] == counts.core_percent["GPU-0"] == 0
    assert counts.shared_cards() == set() and counts.holders == {}


def test_totals_add_up_per_card():
    """Two shared allocations on one card add up; another card is counted apart."""
    counts = CardUsage()
    counts.add(shared("ga-1", units=range(4), percents=range(30)))
    counts.add(shared("ga-2", units=range(4, 6), percents=range(30, 50)))
    counts.add(shared("ga-3", card="GPU-1", units=range(8)))
    assert counts.memory_units == Counter({"GPU-0": 6, "GPU-1": 8})
    assert counts.core_percent == Counter({"GPU-0": 50})
    assert counts.shared_cards() == {"GPU-0", "GPU-1"}
    assert counts.whole_cards() == set()


def test_whole_allocations_count_their_cards_not_units():
    """A whole-card allocation marks each of its cards whole and adds no shared totals."""
    counts = CardUsage()
    counts.add(whole("ga-w", "GPU-0", "GPU-1"))
    assert counts.whole_cards() == {"GPU-0", "GPU-1"}
    assert counts.shared_cards() == set()
    assert counts.memory_units["GPU-0"] == 0
    assert counts.holders == {(WHOLE, "GPU-0"): "ga-w", (WHOLE, "GPU-1"): "ga-w"}
    counts.add(whole("ga-w", "GPU-0", "GPU-1"), -1)
    assert counts.whole_cards() == set()


def test_removing_a_stale_holder_keeps_the_new_holders_devices():
    """A device taken over by another allocation stays held by it when the old one is
    counted out."""
    counts = CardUsage()
    old = shared("ga-old", units=range(2))
    new = shared("ga-new", units=range(2))
    counts.add(old)
    counts.add(new)  # kubelet gave the same IDs to the new allocation
    counts.add(old, -1)
    assert counts.holders == {
        (MEM, memory_device_id("GPU-0", 0)): "ga-new",
        (MEM, memory_device_id("GPU-0", 1)): "ga-new",
    }


def test_loads_give_each_cards_room():
    """Free memory and share per card from the totals; the card's name, index, size."""
    counts = CardUsage()
    counts.add(shared("ga-1", units=range(4), percents=range(30)))
    [gpu0, gpu1] = counts.loads(CARDS, UNITS, None, Counter(), {})
    assert (gpu0.index, gpu0.uuid, gpu0.name, gpu0.memory_units_total) == (
        0,
        "GPU-0",
        "Tesla T4",
        15,
    )
    assert (gpu0.memory_units_free, gpu0.core_percent_free, gpu0.unavailable_reason) == (11, 70, "")
    assert (gpu1.memory_units_free, gpu1.core_percent_free) == (40, 100)


@pytest.mark.parametrize("kind", [MEM, CORE])
def test_kubelets_free_ids_are_the_truth_for_the_resource_asked(kind):
    """For the resource being allocated, kubelet's count of free IDs replaces ours (it may
    know of devices our ledger has not caught up with); the other resource stays ours."""
    counts = CardUsage()
    counts.add(shared("ga-1", units=range(4), percents=range(30)))
    kubelet_free = Counter({"GPU-0": 3, "GPU-1": 7})
    gpu0, gpu1 = counts.loads(CARDS, UNITS, kind, kubelet_free, {})
    if kind is MEM:
        assert (gpu0.memory_units_free, gpu0.core_percent_free) == (3, 70)
        assert (gpu1.memory_units_free, gpu1.core_percent_free) == (7, 100)
    else:
        assert (gpu0.memory_units_free, gpu0.core_percent_free) == (11, 3)
        assert (gpu1.memory_units_free, gpu1.core_percent_free) == (40, 7)


def test_a_card_given_out_whole_is_unavailable_whatever_its_problem():
    """A whole card takes no shared work ("given out whole" wins over a card problem);
    a card problem shows as the reason otherwise."""
    counts = CardUsage()
    counts.add(whole("ga-w", "GPU-0"))
    problems = {"GPU-0": "MPS down", "GPU-1": "MPS down"}
    gpu0, gpu1 = counts.loads(CARDS, UNITS, None, Counter(), problems)
    assert gpu0.unavailable_reason == "given out whole"
    assert gpu1.unavailable_reason == "MPS down"


def test_room_never_goes_below_zero():
    """More held than the card has (a smaller memory unit after a restart): zero free."""
    counts = CardUsage()
    counts.add(shared("ga-1", units=range(20), percents=range(100)))
    [gpu0, _] = counts.loads(CARDS, UNITS, None, Counter(), {})
    assert (gpu0.memory_units_free, gpu0.core_percent_free) == (0, 0)


def test_single_request():
    """One shared resource alone: the other part of the request is zero."""
    assert single_request(MEM, 4) == SharedRequest(memory_units=4)
    assert single_request(CORE, 30) == SharedRequest(core_percent=30)


# --- take_over_devices ------------------------------------------------------------------


def holders_of(*allocations):
    counts = CardUsage()
    for allocation in allocations:
        counts.add(allocation)
    return counts.holders


def test_free_devices_are_simply_stored():
    """Devices nobody holds: the allocation is written, nothing deleted."""
    new = shared("ga-new", units=range(2))
    assert take_over_devices(new, {}, {}, 1024) == ([new], [])


def test_an_allocations_own_devices_are_no_take_over():
    """Re-storing an allocation with its own devices touches no other allocation."""
    a = shared("ga-1", units=range(2))
    b = a.with_devices(CORE, [core_device_id("GPU-0", 0)])
    assert take_over_devices(b, holders_of(a), {"ga-1": a}, 1024) == ([b], [])


def test_a_stale_holder_keeps_what_kubelet_did_not_give_away(caplog):
    """kubelet gave two of a stale holder's four units away: the holder keeps the other
    two (memory_mib recomputed), with one warning naming both allocations."""
    owner = ContainerRef("ml", "old", "main")
    stale = shared("ga-old", units=range(4), percents=range(10), owner=owner)
    new = shared("ga-new", units=range(2))
    with caplog.at_level(logging.WARNING, logger=usage.__name__):
        puts, deletes = take_over_devices(new, holders_of(stale), {"ga-old": stale}, 512)
    assert deletes == []
    assert puts[0] is new
    remaining = puts[1]
    assert remaining.id == "ga-old" and remaining.owner == owner
    assert remaining.devices[MEM] == (memory_device_id("GPU-0", 2), memory_device_id("GPU-0", 3))
    assert remaining.core_percent == 10
    assert remaining.memory_mib == 2 * 512
    [record] = caplog.records
    message = record.getMessage()
    assert "ga-old (ml/old/main)" in message and "to allocation ga-new" in message
    assert "kubelet's record wins" in message


def test_a_stale_holder_left_with_nothing_is_deleted():
    """A holder whose every device kubelet gave away is deleted, not kept empty."""
    stale = shared("ga-old", units=range(2))
    new = shared("ga-new", units=range(3))
    puts, deletes = take_over_devices(new, holders_of(stale), {"ga-old": stale}, 1024)
    assert (puts, deletes) == ([new], ["ga-old"])


def test_several_stale_holders():
    """Devices from two stale holders: each is trimmed or deleted on its own."""
    a = shared("ga-a", units=range(2))
    b = shared("ga-b", units=range(2, 4))
    new = shared("ga-new", units=range(1, 4))
    puts, deletes = take_over_devices(new, holders_of(a, b), {"ga-a": a, "ga-b": b}, 1024)
    assert deletes == ["ga-b"]
    assert [p.id for p in puts] == ["ga-new", "ga-a"]
    assert puts[1].devices == {MEM: (memory_device_id("GPU-0", 0),)}
