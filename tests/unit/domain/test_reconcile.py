"""Pins reconcile: kubelet's PodResources record always wins over the ledger."""

import itertools
from dataclasses import replace

from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.reconcile import plan_reconcile

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE
POD_A = ContainerRef("default", "a", "main")
POD_B = ContainerRef("default", "b", "main")


def ids(card, kind, n, start=0):
    prefix = "c" if kind is CORE else ""
    return tuple(f"{card}-_-{prefix}{j}" for j in range(start, start + n))


def alloc(id_, devices, created_at=100.0, owner=None, confirmed_at=None):
    units = len(devices.get(MEM, ()))
    return Allocation(id_, devices, units * 1024, created_at, owner, confirmed_at)


def plan(allocations, reported, now=110.0, grace=60.0):
    counter = itertools.count(1)
    return plan_reconcile(allocations, reported, now, grace, 1024, lambda: f"new-{next(counter)}")


def report(ref, devices):
    return {(kind, i): ref for kind, group in devices.items() for i in group}


def test_reported_allocation_gets_its_owner_once():
    devices = {MEM: ids("GPU-a", MEM, 4), CORE: ids("GPU-a", CORE, 30)}
    result = plan([alloc("ga-1", devices)], report(POD_A, devices))
    assert [(a.id, a.owner, a.confirmed_at) for a in result.put] == [("ga-1", POD_A, 110.0)]
    # Already confirmed with the same owner: nothing to write.
    assert plan(result.put, report(POD_A, devices)).empty


def test_fresh_unreported_allocation_is_kept_within_grace_then_released():
    devices = {MEM: ids("GPU-a", MEM, 4)}
    assert plan([alloc("ga-1", devices, created_at=100.0)], {}, now=150.0).empty
    result = plan([alloc("ga-1", devices, created_at=100.0)], {}, now=161.0)
    assert result.delete == ["ga-1"] and "within 60 s" in result.notes[0]


def test_confirmed_allocation_no_longer_reported_is_released_at_once():
    devices = {MEM: ids("GPU-a", MEM, 4)}
    confirmed = alloc("ga-1", devices, created_at=109.0, owner=POD_A, confirmed_at=109.5)
    result = plan([confirmed], {}, now=110.0)
    assert result.delete == ["ga-1"]
    assert "default/a/main" in result.notes[0]


def test_devices_kubelet_gave_to_two_containers_are_split():
    mem, core = ids("GPU-a", MEM, 4), ids("GPU-a", CORE, 30)
    reported = {**report(POD_A, {MEM: mem}), **report(POD_B, {CORE: core})}
    result = plan([alloc("ga-1", {MEM: mem, CORE: core})], reported)
    by_id = {a.id: a for a in result.put}
    assert by_id["ga-1"].devices == {MEM: mem} and by_id["ga-1"].owner == POD_A
    assert by_id["new-1"].devices == {CORE: tuple(sorted(core))} and by_id["new-1"].owner == POD_B
    assert by_id["new-1"].memory_mib == 0


def test_devices_unknown_to_the_ledger_are_adopted_per_container_and_card():
    reported = {
        **report(POD_A, {MEM: ids("GPU-a", MEM, 2), CORE: ids("GPU-a", CORE, 10)}),
        **report(POD_B, {WHOLE: ("GPU-b",)}),
    }
    result = plan([], reported)
    adopted = sorted((a.owner.pod, a.whole, a.memory_mib, a.core_percent) for a in result.put)
    assert adopted == [("a", False, 2048, 10), ("b", True, 0, 0)]
    assert all("adopted" in note for note in result.notes)


def test_only_reported_devices_remain_when_kubelet_holds_fewer():
    mem = ids("GPU-a", MEM, 4)
    reported = report(POD_A, {MEM: mem[:2]})
    result = plan([alloc("ga-1", {MEM: mem}, owner=POD_A, confirmed_at=100.0)], reported)
    assert result.put[0].devices == {MEM: mem[:2]} and result.put[0].memory_mib == 2048


def test_adopted_devices_keep_the_allocation_id_their_container_was_registered_with():
    """After a lost ledger, the IDs read back from the running containers (id_hints: pod
    identity -> old allocation ID) name the adopted allocations again, so the env kubelet
    replays at a container restart still names a live allocation."""
    devices = {MEM: ids("GPU-a", MEM, 2), CORE: ids("GPU-a", CORE, 10)}
    other = {MEM: ids("GPU-b", MEM, 1)}
    reported = {**report(POD_A, devices), **report(POD_B, other)}
    counter = itertools.count(1)
    result = plan_reconcile(
        [], reported, 110.0, 60.0, 1024, lambda: f"new-{next(counter)}",
        id_hints={POD_A: "ga-old-a"},
    )  # fmt: skip
    by_pod = {a.owner.pod: a.id for a in result.put}
    assert by_pod["a"] == "ga-old-a" and by_pod["b"].startswith("new-")


def test_a_hint_is_used_by_pod_when_the_container_name_differs_and_never_twice():
    """An init container's mark names the init container, kubelet names the app container
    holding the devices: the pod's one old ID still applies. An ID already live, or one pod
    with two adopted allocations, gets a new ID instead (a hint never double-books an ID)."""
    init = ContainerRef("default", "a", "init")
    devices = {MEM: ids("GPU-a", MEM, 2)}
    counter = itertools.count(1)
    result = plan_reconcile(
        [], report(POD_A, devices), 110.0, 60.0, 1024, lambda: f"new-{next(counter)}",
        id_hints={init: "ga-old-a"},
    )  # fmt: skip
    assert [a.id for a in result.put] == ["ga-old-a"]
    live = alloc("ga-old-a", {MEM: ids("GPU-b", MEM, 1)}, owner=POD_B, confirmed_at=100.0)
    reported = {**report(POD_A, devices), **report(POD_B, live.devices)}
    counter = itertools.count(1)
    again = plan_reconcile(
        [live], reported, 110.0, 60.0, 1024, lambda: f"new-{next(counter)}",
        id_hints={POD_A: "ga-old-a"},
    )  # fmt: skip
    assert [a.id for a in again.put if a.owner == POD_A] == ["new-1"]


def test_two_allocations_kubelet_gives_one_container_on_one_card_are_merged():
    """A container's memory and share in two allocations (its second resource's Allocate
    came apart from the first, e.g. retried after a timeout) made one pod count twice:
    385 allocations for 384 pods. kubelet's record says one container holds both: they
    become one allocation, under the memory holder's ID, with both quotas."""
    memory = alloc("ga-mem", {MEM: ids("GPU-a", MEM, 2)}, owner=POD_A, confirmed_at=100.0)
    share = alloc("ga-core", {CORE: ids("GPU-a", CORE, 20)}, owner=POD_A, confirmed_at=100.0)
    other = alloc("ga-b", {MEM: ids("GPU-a", MEM, 1, start=5)}, owner=POD_B, confirmed_at=100.0)
    reported = {
        **report(POD_A, memory.devices),
        **report(POD_A, share.devices),
        **report(POD_B, other.devices),
    }
    result = plan([memory, share, other], reported)
    assert result.delete == ["ga-core"]
    [merged] = [a for a in result.put if a.id == "ga-mem"]
    assert {k: set(v) for k, v in merged.devices.items()} == {
        MEM: set(memory.devices[MEM]),
        CORE: set(share.devices[CORE]),
    }
    assert merged.memory_mib == 2048 and merged.core_percent == 20
    assert any("merged" in note for note in result.notes)
    # Applied, the ledger is stable: nothing more to change.
    assert plan([merged, other], reported).empty


def test_allocations_of_one_container_on_two_cards_are_not_merged():
    """One container's shares on two cards stay two allocations (one per card)."""
    on_a = alloc("ga-a", {MEM: ids("GPU-a", MEM, 1)}, owner=POD_A, confirmed_at=100.0)
    on_b = alloc("ga-b", {MEM: ids("GPU-b", MEM, 1)}, owner=POD_A, confirmed_at=100.0)
    reported = {**report(POD_A, on_a.devices), **report(POD_A, on_b.devices)}
    assert plan([on_a, on_b], reported).empty


WEB = ContainerRef("default", "web-0", "main")


def owned(allocation, uid):
    return replace(allocation, owner_uid=uid)


def test_an_owner_in_another_pod_drops_the_uid_and_one_in_the_same_pod_keeps_it():
    """The UID an allocation was made with is its pod's: kubelet's record naming a
    container of another pod (the pod cache's guess was wrong) leaves it unknown; naming
    another container of the same pod keeps it."""
    devices = {MEM: ids("GPU-a", MEM, 2)}
    made = owned(alloc("ga-1", devices, owner=POD_A), "uid-a")
    [moved] = plan([made], report(POD_B, devices)).put
    assert (moved.owner, moved.owner_uid) == (POD_B, None)
    side = ContainerRef("default", "a", "side")
    [kept] = plan([made], report(side, devices)).put
    assert (kept.owner, kept.owner_uid) == (side, "uid-a")


def test_a_split_keeps_the_uid_within_its_pod_only():
    """Devices of one allocation kubelet gives to a container of the same pod and to one
    of another pod: the part split off within the pod keeps the pod's UID, the other not."""
    mem, core = ids("GPU-a", MEM, 2), ids("GPU-a", CORE, 20)
    side = ContainerRef("default", "a", "side")
    made = owned(alloc("ga-1", {MEM: mem, CORE: core[:10]}, owner=POD_A), "uid-a")
    within = {**report(POD_A, {MEM: mem}), **report(side, {CORE: core[:10]})}
    by_owner = {a.owner: a.owner_uid for a in plan([made], within).put}
    assert by_owner == {POD_A: "uid-a", side: "uid-a"}
    across = {**report(POD_A, {MEM: mem}), **report(POD_B, {CORE: core[:10]})}
    by_owner = {a.owner: a.owner_uid for a in plan([made], across).put}
    assert by_owner == {POD_A: "uid-a", POD_B: None}


def test_the_old_and_the_new_pod_of_one_name_are_never_merged():
    """web-0 deleted and created again: its old allocation (old UID, not yet released) and
    the new one (new UID) on one card, and a record read before kubelet let the old pod go
    reports both for web-0/main. They are two pods' allocations: not merged into one quota
    (the old one goes when kubelet no longer reports it)."""
    old = owned(alloc("ga-old", {MEM: ids("GPU-a", MEM, 2)}, owner=WEB, confirmed_at=100.0),
                "uid-old")  # fmt: skip
    new = owned(alloc("ga-new", {MEM: ids("GPU-a", MEM, 2, start=2), CORE: ids("GPU-a", CORE, 10)},
                      owner=WEB), "uid-new")  # fmt: skip
    stale = {**report(WEB, old.devices), **report(WEB, new.devices)}
    result = plan([old, new], stale)
    assert result.delete == []
    assert [(a.id, a.owner_uid, a.memory_units) for a in result.put] == [("ga-new", "uid-new", 2)]
    assert any("not merged" in note and "uid-old" in note for note in result.notes)
    # The record once kubelet let the old pod go: the old allocation goes, the new stays.
    fresh = plan([old, *result.put], report(WEB, new.devices))
    assert fresh.delete == ["ga-old"] and fresh.put == []


def test_a_merge_keeps_the_one_uid_known():
    """A container's memory and share in two allocations, one made with its pod known (a
    UID) and one without: merged, the allocation keeps that UID."""
    memory = alloc("ga-mem", {MEM: ids("GPU-a", MEM, 2)}, owner=POD_A, confirmed_at=100.0)
    share = owned(alloc("ga-core", {CORE: ids("GPU-a", CORE, 20)}, owner=POD_A,
                        confirmed_at=100.0), "uid-a")  # fmt: skip
    result = plan(
        [memory, share], {**report(POD_A, memory.devices), **report(POD_A, share.devices)}
    )
    [merged] = result.put
    assert (merged.id, merged.owner_uid, merged.core_percent) == ("ga-mem", "uid-a", 20)
