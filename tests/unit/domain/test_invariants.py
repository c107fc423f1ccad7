"""Pins the ledger's invariants: each kind of breakage is found and named; a sound set of
allocations gives no problem."""

from nodemgr.domain.deviceids import ResourceKind, core_device_id, memory_device_id
from nodemgr.domain.invariants import CardCapacity, check_invariants
from nodemgr.domain.model import Allocation, CgroupKey, ContainerRef, Registration
from standins.cards import GPU0, GPU1

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE
CARDS = [CardCapacity(GPU0, 0, 4), CardCapacity(GPU1, 1, 2)]


def shared(id_, card=GPU0, units=(0,), percents=(0,), memory_mib=None, owner=None, **kw):
    devices = {}
    if units:
        devices[MEM] = tuple(memory_device_id(card, u) for u in units)
    if percents:
        devices[CORE] = tuple(core_device_id(card, p) for p in percents)
    mib = len(units) * 1024 if memory_mib is None else memory_mib
    return Allocation(id_, devices, mib, 1000.0, owner=owner, **kw)


def whole(id_, card=GPU1):
    return Allocation(id_, {WHOLE: (card,)}, 0, 1000.0)


def test_sound_allocations_have_no_problem():
    """Two shared allocations on one card and a whole other card: nothing to report."""
    assert (
        check_invariants(
            [shared("a", units=(0, 1)), shared("b", units=(2,), percents=(1, 2)), whole("c")],
            CARDS,
            1024,
        )
        == []
    )


def test_a_device_held_twice_is_named_with_both_holders():
    """The worst breakage: one device in two live allocations."""
    [problem] = check_invariants([shared("a"), shared("b", percents=(5,))], CARDS, 1024)
    assert memory_device_id(GPU0, 0) in problem and "a" in problem and "b" in problem


def test_capacity_whole_and_shared_and_range_are_checked():
    """Memory beyond the card, a whole card with shared work, and an ID past the card's
    range are each named by card."""
    over = shared("a", card=GPU1, units=(0, 1), percents=())
    past = shared("b", card=GPU1, units=(2,), percents=())
    problems = check_invariants([over, past, whole("c")], CARDS, 1024)
    text = " | ".join(problems)
    assert "GPU1 has 3 memory units allocated of 2" in text
    assert "beyond GPU1's 2 memory devices" in text
    assert "GPU1 is given out whole and also holds shared work" in text


def test_limit_and_one_card_rules():
    """A shared allocation's limit matches its units, and it sits on one card."""
    wrong_limit = shared("a", memory_mib=999)
    split = Allocation(
        "b", {MEM: (memory_device_id(GPU0, 3),), CORE: (core_device_id(GPU1, 0),)}, 1024, 1.0
    )
    text = " | ".join(check_invariants([wrong_limit, split], CARDS, 1024))
    assert "allocation a says 999 MiB but holds 1 units" in text
    assert "shared allocation b spans 2 cards" in text


def test_registrations_of_freed_allocations_and_unknown_capacities():
    """A container registered to a gone allocation is named; without card capacities the
    capacity checks are skipped rather than guessed."""
    registration = Registration("ctr-1", "ga-gone", CgroupKey("", "/x"), 10, 20, None, 1.0)
    over = shared("a", card=GPU1, units=(0, 1, 2), percents=())
    problems = check_invariants([over], None, 1024, [registration])
    assert problems == [
        "container ctr-1 is registered to allocation ga-gone, which no longer exists"
    ]


def test_kubelet_record_must_match_after_a_reconcile():
    """Devices kubelet reports must be held, by the same container; a confirmed allocation
    kubelet stopped reporting must be gone."""
    ref = ContainerRef("ns", "p", "c")
    other = ContainerRef("ns", "q", "c")
    held = shared("a", owner=ref, confirmed_at=5.0)
    stale = shared("b", units=(3,), percents=(), owner=other, confirmed_at=5.0)
    record = {
        ref: {MEM: [memory_device_id(GPU0, 0), memory_device_id(GPU0, 2)]},
    }
    text = " | ".join(check_invariants([held, stale], CARDS, 1024, kubelet_record=record))
    assert f"kubelet says {ref} holds {memory_device_id(GPU0, 2)} (memory), but no" in text
    assert "allocation b (ns/q/c) was confirmed by kubelet but kubelet no longer reports" in text


def test_a_claims_allocation_must_hold_the_cards_its_results_name_once():
    """A claim's allocation on another card than its results name, or two allocations of
    one claim: each named."""
    from dataclasses import replace

    from nodemgr.domain.deviceids import ResourceKind
    from nodemgr.domain.model import Allocation, ClaimRef, ClaimResult

    claim = ClaimRef("u1", "ns", "c", (ClaimResult("gpu", "node-a", "gpu-b", None),))
    held = Allocation("ga-1", {ResourceKind.WHOLE: ("GPU-A",)}, 0, 1.0, claim=claim)
    twice = replace(held, id="ga-2", devices={ResourceKind.WHOLE: ("GPU-B",)})
    problems = check_invariants([held, twice], None, 1024)
    assert any("holds cards GPU-A but its results name devices gpu-b" in p for p in problems)
    assert any("claim ns/c (UID u1) has two allocations, ga-1 and ga-2" in p for p in problems)
