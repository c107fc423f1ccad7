"""Pins nodemgr.allocation.admission: which open container a second shared request is
carried onto (its pod's exact request, else a request within the admission window);
which shared resources each known container holds; DemandFinder finding the admitted
container in the pod cache (reading only the pods asking that resource and size) and
waiting for the watch only while it is live, and never past POD_WAIT_SECONDS;
place_demand honouring the scheduler extender's card or refusing it clearly (stale
view, no such GPU); and the refusal text of a carried request."""

import logging
from dataclasses import replace

import pytest

from nodemgr.allocation import admission
from nodemgr.allocation.admission import (
    ADMISSION_WINDOW_SECONDS,
    POD_WAIT_SECONDS,
    DemandFinder,
    OpenAdmission,
    carried_allocation,
    carry_refusal,
    place_demand,
)
from nodemgr.allocation.usage import CardUsage, HeldByName
from nodemgr.domain.deviceids import ResourceKind, core_device_id, memory_device_id
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.placement import CardLoad, NoFitDescriber
from nodemgr.domain.podmatch import ContainerRequest, Demand, PodInfo, asked_sizes, find_demand
from nodemgr.errors import NoFitError

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE
MEM_NAME, CORE_NAME, WHOLE_NAME = "aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage", "g"
NAMES = {MEM: MEM_NAME, CORE: CORE_NAME, WHOLE: WHOLE_NAME}
DESCRIBE = NoFitDescriber("node-a", 1024)


def shared(id_="ga-1", units=4, percent=0, card="GPU-0", owner=None):
    devices = {}
    if units:
        devices[MEM] = tuple(memory_device_id(card, j) for j in range(units))
    if percent:
        devices[CORE] = tuple(core_device_id(card, j) for j in range(percent))
    return Allocation(id_, devices, units * 1024, 1000.0, owner=owner)


def demand(memory_units=4, core_percent=30, extender=None, container="main"):
    return Demand("ml", "train-0", container, 0, memory_units, core_percent, extender)


# --- carried_allocation -----------------------------------------------------------------


def test_nothing_is_carried_without_an_open_admission():
    """No container is being admitted: a request starts a new allocation."""
    assert carried_allocation(None, {"ga-1": shared()}, CORE, 30, 0.0) is None


def test_nothing_is_carried_when_the_open_allocation_is_gone():
    """The open container's allocation was released meanwhile: nothing to carry onto."""
    open_ = OpenAdmission("ga-1", 0.0, None)
    assert carried_allocation(open_, {}, CORE, 30, 0.0) is None


def test_a_resource_already_held_is_not_carried_twice():
    """The open container already holds this kind: the request is another container's."""
    open_ = OpenAdmission("ga-1", 0.0, None)
    assert carried_allocation(open_, {"ga-1": shared()}, MEM, 4, 0.0) is None


@pytest.mark.parametrize("late", [0.0, ADMISSION_WINDOW_SECONDS * 10])
def test_with_the_pod_known_the_exact_request_is_carried_at_any_time(late):
    """With its pod known, the second request is carried when its size is what the pod
    asks, however late it comes; another size is not the same container."""
    allocation = shared()
    open_ = OpenAdmission("ga-1", 0.0, demand(memory_units=4, core_percent=30))
    allocations = {"ga-1": allocation}
    assert carried_allocation(open_, allocations, CORE, 30, late) is allocation
    assert carried_allocation(open_, allocations, CORE, 20, late) is None


def test_with_the_pod_known_memory_sizes_are_compared_too():
    """A memory request after a core one is matched against the pod's memory units."""
    allocation = shared(units=0, percent=30)
    open_ = OpenAdmission("ga-1", 0.0, demand(memory_units=6, core_percent=30))
    assert carried_allocation(open_, {"ga-1": allocation}, MEM, 6, 0.0) is allocation
    assert carried_allocation(open_, {"ga-1": allocation}, MEM, 4, 0.0) is None


def test_without_the_pod_only_within_the_admission_window():
    """Without pod identity, any size is carried within the window, and none after it."""
    allocation = shared()
    open_ = OpenAdmission("ga-1", 100.0, None)
    allocations = {"ga-1": allocation}
    assert carried_allocation(open_, allocations, CORE, 77, 100.0) is allocation
    edge = 100.0 + ADMISSION_WINDOW_SECONDS
    assert carried_allocation(open_, allocations, CORE, 77, edge) is allocation
    assert carried_allocation(open_, allocations, CORE, 77, edge + 0.01) is None


# --- which shared resources each container holds (CardUsage.held_kinds) ------------------


def test_held_per_known_container():
    """Each container with a known owner holds the names of its shared resources; whole
    allocations and allocations of no known owner do not count."""
    a = ContainerRef("ml", "train-0", "main")
    b = ContainerRef("ml", "train-1", "main")
    allocations = [
        shared("ga-1", units=4, percent=30, owner=a),
        shared("ga-2", units=0, percent=10, owner=b),
        shared("ga-3", units=2, owner=None),
        Allocation("ga-4", {WHOLE: ("GPU-1",)}, 0, 1000.0, owner=ContainerRef("ml", "w", "m")),
    ]
    usage = CardUsage()
    for allocation in allocations:
        usage.add(allocation)
    assert dict(HeldByName(usage.held_kinds, NAMES)) == {
        ("ml", "train-0", "main", ""): frozenset({MEM_NAME, CORE_NAME}),
        ("ml", "train-1", "main", ""): frozenset({CORE_NAME}),
    }


def test_held_per_pod_uid_where_known():
    """Two allocations of one name made for two pods (web-0 deleted and created again):
    each held under its own pod's UID; one of unknown UID under ""."""
    web = ContainerRef("ml", "web-0", "main")
    usage = CardUsage()
    usage.add(replace(shared("ga-1", units=4, percent=30, owner=web), owner_uid="uid-old"))
    usage.add(replace(shared("ga-2", units=2, owner=web), owner_uid="uid-new"))
    usage.add(shared("ga-3", units=0, percent=5, owner=web))
    assert dict(HeldByName(usage.held_kinds, NAMES)) == {
        ("ml", "web-0", "main", "uid-old"): frozenset({MEM_NAME, CORE_NAME}),
        ("ml", "web-0", "main", "uid-new"): frozenset({MEM_NAME}),
        ("ml", "web-0", "main", ""): frozenset({CORE_NAME}),
    }


# --- DemandFinder -----------------------------------------------------------------------


def pod(name, requests, created=100.0):
    return PodInfo(
        namespace="ml",
        name=name,
        uid=f"uid-{name}",
        node_name="node-a",
        phase="Pending",
        created_at=created,
        deleting=False,
        annotations={},
        containers=(ContainerRequest("main", requests),),
    )


class FakePods:
    """A PodSource: ``arrivals`` come in at the nth wait_for_change; waits advance ``now``.

    Its ``candidates`` (every pending pod) fails the test: DemandFinder must read only the
    index of the pods asking (``candidates_asking``), which ``asked`` records."""

    def __init__(self, pods=(), live=True, arrivals=None):
        self.pods = list(pods)
        self.live = live
        self.generation = 0
        self.now = 0.0
        self.waits: list[float] = []
        self._arrivals = dict(arrivals or {})
        self.asked: list[tuple[str, int]] = []

    def candidates(self):
        raise AssertionError("DemandFinder walked every candidate pod")

    def candidates_asking(self, resource, size):
        self.asked.append((resource, size))
        return tuple(p for p in self.pods if (resource, size) in asked_sizes(p))

    def wait_for_change(self, seen_generation, timeout):
        self.waits.append(timeout)
        arriving = self._arrivals.pop(len(self.waits), None)
        if arriving is not None:
            self.pods.append(arriving)
            self.now += timeout / 10
            self.generation += 1
        else:
            self.now += timeout
        return self.generation

    def monotonic(self):
        return self.now


def finder(pods: FakePods) -> DemandFinder:
    return DemandFinder(pods, NAMES, "node-a", pods.monotonic)


def test_a_cached_pod_is_found_without_waiting():
    """The pod is already in the cache: its container's whole demand, no wait."""
    pods = FakePods([pod("train-0", {MEM_NAME: 4, CORE_NAME: 30})])
    found = finder(pods).find(MEM, 4, {})
    assert (found.pod, found.container, found.memory_units, found.core_percent) == (
        "train-0",
        "main",
        4,
        30,
    )
    assert pods.waits == []


def test_a_pod_arriving_through_the_watch_is_found():
    """Not cached yet but the watch is live: the finder waits for the cache to change,
    re-checks after each change (an unrelated pod first) and finds the pod when it arrives."""
    pods = FakePods(arrivals={1: pod("other", {MEM_NAME: 2}), 2: pod("late", {CORE_NAME: 20})})
    found = finder(pods).find(CORE, 20, {})
    assert found is not None and found.pod == "late"
    assert len(pods.waits) == 2


def test_no_wait_when_the_watch_is_not_live():
    """With the API server down (watch not live) a miss returns None at once."""
    pods = FakePods([pod("other", {MEM_NAME: 2})], live=False)
    assert finder(pods).find(MEM, 4, {}) is None
    assert pods.waits == []


def test_a_miss_waits_at_most_pod_wait_seconds_and_says_so(caplog):
    """Nothing matching arrives: the waits add up to POD_WAIT_SECONDS, then None and one
    log line saying the container is admitted without pod identity."""
    pods = FakePods([pod("other", {MEM_NAME: 2})])
    with caplog.at_level(logging.INFO, logger=admission.__name__):
        assert finder(pods).find(MEM, 4, {}) is None
    assert sum(pods.waits) == pytest.approx(POD_WAIT_SECONDS)
    [record] = caplog.records
    assert record.getMessage() == (
        f"{MEM_NAME}: no pod bound to node-a asks for 4; admitting without pod identity"
    )


def test_the_finder_reads_only_the_pods_asking_that_size():
    """Allocate's match reads the index of pods asking (resource, size), never every
    candidate (400 pending pods made each Allocate walk them all), for the resource and
    size kubelet asked, also on each re-check after a wait; the demand is the one the
    match over every pod finds."""
    every = [
        pod("big", {MEM_NAME: 8, CORE_NAME: 50}, created=1.0),
        pod("share", {CORE_NAME: 30}, created=2.0),
        pod("train", {MEM_NAME: 4, CORE_NAME: 30}, created=3.0),
        pod("twin", {MEM_NAME: 4, CORE_NAME: 20}, created=4.0),
    ]
    pods = FakePods(every)
    for kind, name, size in ((MEM, MEM_NAME, 4), (CORE, CORE_NAME, 30), (CORE, CORE_NAME, 20)):
        pods.asked.clear()
        expected = find_demand(every, name, size, MEM_NAME, CORE_NAME, {})
        assert expected is not None
        assert finder(pods).find(kind, size, {}) == expected
        assert pods.asked == [(name, size)]
    late = FakePods([pod("other", {MEM_NAME: 2})], arrivals={1: pod("late", {MEM_NAME: 4})})
    assert finder(late).find(MEM, 4, {}).pod == "late"
    assert late.asked == [(MEM_NAME, 4), (MEM_NAME, 4)]


def test_a_container_holding_this_resource_is_skipped():
    """A container that already holds the resource asked for is not the one asking."""
    pods = FakePods(
        [pod("first", {MEM_NAME: 4}, created=1.0), pod("second", {MEM_NAME: 4}, created=2.0)],
        live=False,
    )
    held = {("ml", "first", "main", "uid-first"): frozenset({MEM_NAME})}
    assert finder(pods).find(MEM, 4, held).pod == "second"


# --- place_demand -----------------------------------------------------------------------


def load(index, free_units, core_free=100, total=15, reason=""):
    return CardLoad(index, f"GPU-{index}", "Tesla T4", total, free_units, core_free, reason)


LOADS = [load(0, 15), load(1, 5)]


def test_without_the_extender_the_policy_places_memory_and_share_together():
    """No extender card: the policy picks the card (binpack: the fullest that fits both)."""
    assert place_demand(demand(4, 30), LOADS, "binpack", DESCRIBE, "node-a") == "GPU-1"
    assert place_demand(demand(4, 30), LOADS, "spread", DESCRIBE, "node-a") == "GPU-0"
    assert place_demand(demand(6, 30), LOADS, "binpack", DESCRIBE, "node-a") == "GPU-0"


def test_no_fit_names_the_container():
    """No card fits: the refusal lists the cards and names the container it was for."""
    with pytest.raises(NoFitError) as refused:
        place_demand(demand(16, 30), LOADS, "binpack", DESCRIBE, "node-a")
    text = str(refused.value)
    assert text.startswith("no single GPU on node-a has 16 GiB and 30% free: GPU0")
    assert text.endswith("(for ml/train-0/main)")


def test_the_extenders_card_is_honoured_over_the_policy():
    """The scheduler extender chose GPU0: it is used though binpack would pick GPU1."""
    assert place_demand(demand(4, 30, extender=0), LOADS, "binpack", DESCRIBE, "n") == "GPU-0"


def test_a_stale_extender_card_is_refused_clearly():
    """The extender's card has no room any more: refused, naming the card, what the
    container needs, what the card has, and that the extender's view is stale."""
    with pytest.raises(NoFitError) as refused:
        place_demand(demand(6, 30, extender=1), LOADS, "binpack", DESCRIBE, "node-a")
    text = str(refused.value)
    assert text.startswith(
        "the scheduler extender chose GPU1 for ml/train-0/main, which needs 6 GiB and 30%, "
        "but GPU1 (Tesla T4) has 5 GiB/100% free"
    )
    assert "the extender's view of this node is stale" in text
    assert "nodemgr status" in text


def test_an_extender_card_given_out_whole_is_refused():
    """A card unavailable for sharing is refused even when its free numbers would fit."""
    loads = [load(0, 15, reason="given out whole"), load(1, 15)]
    with pytest.raises(NoFitError, match=r"GPU0 \(Tesla T4\) has none \(given out whole\)"):
        place_demand(demand(4, 30, extender=0), loads, "binpack", DESCRIBE, "node-a")


def test_an_extender_card_this_node_does_not_have_is_refused():
    """The extender chose GPU7 on a two-card node: refused, naming the node's range."""
    with pytest.raises(NoFitError) as refused:
        place_demand(demand(4, 30, extender=7), LOADS, "binpack", DESCRIBE, "node-a")
    assert str(refused.value) == (
        "the scheduler extender chose GPU7 for ml/train-0/main, but node-a has no such GPU "
        "(it has GPU0 to GPU1): the extender's view of this node is stale"
    )


# --- carry_refusal ----------------------------------------------------------------------


def test_carry_refusal_with_the_pod_known():
    """With the pod known: the whole request that does not fit, and that the container
    already holds its other resource on that card."""
    carried = shared(units=4)
    text = carry_refusal(DESCRIBE, LOADS, CORE_NAME, CORE, carried, 30, "GPU1", demand(4, 30))
    assert text.startswith("no single GPU on node-a has 4 GiB and 30% free: ")
    assert text.endswith(
        f"; ml/train-0/main already holds its other GPU resource on GPU1, which has no room "
        f"left for its {CORE_NAME} request"
    )


def test_carry_refusal_without_the_pod():
    """Without the API: says the first resource was placed before the second was known."""
    carried = shared(units=0, percent=30)
    text = carry_refusal(DESCRIBE, LOADS, MEM_NAME, MEM, carried, 8, "GPU0")
    assert text.startswith("no single GPU on node-a has 8 GiB and 30% free: ")
    assert "first GPU resource was already placed on GPU0 before its " + MEM_NAME in text
    assert "without the Kubernetes API" in text
