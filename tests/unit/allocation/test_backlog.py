"""Pins nodemgr.allocation.backlog, what the next reconcile judges: everything at first;
then the allocations changed since, the devices an allocation let go (an unheld reported
one is adopted), the holders of the devices whose entry in kubelet's record changed, the
unconfirmed allocations whose grace ended (earliest first, the confirmed and released ones
dropped), and, handed along, the allocations that may merge with those; nothing at all
for the very record object with nothing changed; a plan that could not be committed gives
its work back."""

from nodemgr.allocation.backlog import Backlog, KubeletView
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation, ContainerRef

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE
POD_A = ContainerRef("ns", "a", "main")
POD_B = ContainerRef("ns", "b", "main")


def alloc(id_, *devices, created_at=100.0, confirmed_at=None, owner=None):
    grouped: dict[ResourceKind, tuple[str, ...]] = {}
    for kind, device_id in devices:
        grouped[kind] = (*grouped.get(kind, ()), device_id)
    units = len(grouped.get(MEM, ()))
    return Allocation(id_, grouped, units * 1024, created_at, owner, confirmed_at)


def holders_of(allocations):
    return {key: a.id for a in allocations.values() for key in a.device_pairs()}


def view(record, reported):
    return KubeletView(record, reported)


def settled(backlog, allocations, kubelet):
    """The backlog after one reconcile that changed nothing against ``kubelet``."""
    work = backlog.work(kubelet, allocations, holders_of(allocations))
    backlog.take(work)
    backlog.settled(work, allocations)
    return backlog


def test_the_first_reconcile_walks_everything_then_the_same_record_is_idle():
    """Nothing judged yet: a full walk. Taken, the very record object with nothing changed
    is idle; an equal record in another object is read but judges nothing."""
    backlog = Backlog()
    record = {}
    work = backlog.work(view(record, {}), {}, {})
    assert work.full
    assert not backlog.idle(record)
    backlog.take(work)
    assert backlog.idle(record)
    other = backlog.work(view({}, {}), {}, {})
    assert other.nothing


def test_a_changed_allocation_is_judged_and_the_devices_it_let_go_are_adopted_if_reported():
    """An allocation committed with fewer devices is judged; a device it let go that kubelet
    reports (and nobody holds now) is adopted; a device it kept is not looked at."""
    a = alloc("ga-a", (MEM, "m0"), (MEM, "m1"), confirmed_at=101.0, owner=POD_A)
    allocations = {"ga-a": a}
    kubelet = view({}, {(MEM, "m0"): POD_A, (MEM, "m1"): POD_A})
    backlog = settled(Backlog(), allocations, kubelet)
    smaller = alloc("ga-a", (MEM, "m0"), confirmed_at=101.0, owner=POD_A)
    allocations["ga-a"] = smaller
    backlog.changed(a, smaller)
    work = backlog.work(kubelet, allocations, holders_of(allocations))
    assert not work.full and work.scope is not None
    assert [j.id for j in work.scope.judged] == ["ga-a"]
    assert work.scope.unheld == {(MEM, "m1"): POD_A}
    assert work.keys == {(MEM, "m1")}


def test_a_new_record_object_judges_the_holders_of_the_devices_whose_entry_changed():
    """Of 50 settled allocations, a record without pod 7 and with pod 3's device moved to
    another container judges those two holders alone."""
    allocations = {
        f"ga-{n}": alloc(f"ga-{n}", (MEM, f"m{n}"), confirmed_at=1.0, owner=POD_A)
        for n in range(50)
    }
    reported = {(MEM, f"m{n}"): ContainerRef("ns", f"p{n}", "main") for n in range(50)}
    backlog = settled(Backlog(), allocations, view({}, reported))
    changed = {k: r for k, r in reported.items() if k != (MEM, "m7")}
    changed[(MEM, "m3")] = POD_B
    work = backlog.work(view({}, changed), allocations, holders_of(allocations))
    assert work.scope is not None
    assert [j.id for j in work.scope.judged] == ["ga-3", "ga-7"]
    assert work.scope.unheld == {}


def test_unconfirmed_allocations_are_judged_again_once_their_grace_ended_earliest_first():
    """Left waiting by a reconcile, an unconfirmed allocation is not judged again until its
    grace ended; then only those whose grace ended; one confirmed or released meanwhile is
    dropped from the index."""
    early = alloc("ga-early", (MEM, "m0"), created_at=100.0)
    late = alloc("ga-late", (MEM, "m1"), created_at=150.0)
    gone = alloc("ga-gone", (MEM, "m2"), created_at=90.0)
    confirmed = alloc("ga-confirmed", (MEM, "m3"), created_at=95.0)
    allocations = {a.id: a for a in (early, late, gone, confirmed)}
    kubelet = view({}, {})
    backlog = settled(Backlog(), allocations, kubelet)
    del allocations["ga-gone"]
    allocations["ga-confirmed"] = alloc(
        "ga-confirmed", (MEM, "m3"), created_at=95.0, confirmed_at=120.0, owner=POD_A
    )
    backlog.expire(159.0, 60.0, allocations)
    assert backlog.idle(kubelet.record)
    backlog.expire(161.0, 60.0, allocations)
    work = backlog.work(kubelet, allocations, holders_of(allocations))
    assert work.scope is not None and [j.id for j in work.scope.judged] == ["ga-early"]


def test_allocations_that_may_merge_with_a_judged_one_are_handed_along():
    """A new allocation whose devices kubelet reports for a container that an older, settled
    allocation is reported for too: the older one comes along (not judged) so the two can
    be merged; an allocation of another container does not."""
    first = alloc("ga-first", (MEM, "m0"), confirmed_at=101.0, owner=POD_A)
    other = alloc("ga-other", (MEM, "m5"), confirmed_at=101.0, owner=POD_B)
    allocations = {a.id: a for a in (first, other)}
    reported = {(MEM, "m0"): POD_A, (MEM, "m5"): POD_B}
    backlog = settled(Backlog(), allocations, view({}, reported))
    second = alloc("ga-second", (CORE, "c0"))
    allocations["ga-second"] = second
    backlog.changed(None, second)
    kubelet = view({}, {**reported, (CORE, "c0"): POD_A})
    work = backlog.work(kubelet, allocations, holders_of(allocations))
    assert work.scope is not None
    assert [j.id for j in work.scope.judged] == ["ga-second"]
    assert [o.id for o in work.scope.others] == ["ga-first"]


def test_work_whose_plan_was_not_committed_is_given_back():
    """Taken and given back: the same work again, the record it was judged against as before."""
    a = alloc("ga-a", (MEM, "m0"))
    allocations = {"ga-a": a}
    backlog = settled(Backlog(), allocations, view({}, {}))
    backlog.changed(None, a)
    record = {}
    work = backlog.work(view(record, {}), allocations, holders_of(allocations))
    before = backlog.take(work)
    assert backlog.idle(record)
    backlog.give_back(work, before)
    assert not backlog.idle(record)
    again = backlog.work(view(record, {}), allocations, holders_of(allocations))
    assert again.scope is not None and [j.id for j in again.scope.judged] == ["ga-a"]
