"""Pins nodemgr.domain.podtie: which containers kubelet's PodResources record shows holding an
allocation's devices (by resource name and device ID, any one of them), and whether that ties a
container of a given pod identity to the allocation: only a container of the holding pod
(namespace and name; any container name, as init containers are never listed and hand their
devices on to the app containers), never another pod's, and nobody while two pods hold parts
of it. The refusal names the allocation, its card and both pods. The identity itself is read
again from the annotations' identity keys the hook sent (runtime_identity): two pods named
refuse, and so does a hook whose own reading differs."""

from dataclasses import replace

import pytest

from nodemgr.domain.deviceids import ResourceKind, core_device_id, memory_device_id
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.podtie import (
    holders,
    pod_of,
    pod_tie_problem,
    pods_allocation,
    runtime_identity,
)
from standins.cards import GPU0

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE
NAMES = {MEM: "aliyun.com/gpu-mem", CORE: "aliyun.com/gpu-core.percentage"}
MAIN = ContainerRef("default", "train", "main")


def shared(units=4, percent=30, first_unit=0):
    devices = {MEM: tuple(memory_device_id(GPU0, first_unit + j) for j in range(units))}
    if percent:
        devices[CORE] = tuple(core_device_id(GPU0, j) for j in range(percent))
    return Allocation("ga-1", devices, units * 1024, 100.0)


def record_of(allocation, ref=MAIN):
    return {ref: {NAMES[kind]: list(ids) for kind, ids in allocation.devices.items()}}


def test_holders_are_the_containers_holding_any_of_its_devices():
    """One device ID of the allocation under its resource name is enough; other containers'
    devices are not."""
    allocation = shared()
    stranger = ContainerRef("default", "other", "main")
    record = {
        MAIN: {NAMES[MEM]: [allocation.devices[MEM][2]]},
        stranger: {NAMES[MEM]: [memory_device_id(GPU0, 9)]},
    }
    assert holders(allocation, record, NAMES) == {MAIN}


def test_a_device_id_under_another_resource_name_is_not_held():
    """The same ID string reported for another resource is another device."""
    allocation = shared()
    record = {MAIN: {"nvidia.com/gpu": list(allocation.devices[MEM])}}
    assert holders(allocation, record, NAMES) == set()


def test_an_empty_record_has_no_holders():
    """Nothing reported (the pod is gone): nobody holds it."""
    assert holders(shared(), {}, NAMES) == set()


@pytest.mark.parametrize("container", ["main", "init-weights", "sidecar"])
def test_any_container_of_the_holding_pod_is_tied(container):
    """The app container kubelet lists, a regular init container (never listed: kubelet
    hands its devices on to the app containers) and a sidecar of the same pod."""
    allocation = shared()
    identity = ContainerRef("default", "train", container)
    assert (
        pod_tie_problem(identity, allocation, holders(allocation, record_of(allocation), NAMES))
        is None
    )


@pytest.mark.parametrize(
    "identity",
    [ContainerRef("default", "thief", "main"), ContainerRef("other", "train", "main")],
)
def test_a_container_of_another_pod_is_not_tied(identity):
    """Another pod name, or the same pod name in another namespace: refused, naming the
    allocation, its card, the holding pod and the asking one."""
    allocation = shared()
    problem = pod_tie_problem(
        identity, allocation, holders(allocation, record_of(allocation), NAMES)
    )
    assert problem is not None
    assert f"kubelet gives allocation ga-1 ({GPU0}) to pod default/train" in problem
    assert f"not to pod {pod_of(identity)}" in problem


def test_an_allocation_two_pods_hold_parts_of_ties_nobody():
    """Its memory reported for one pod and its share for another (a linkage the next
    reconcile splits): no container is tied to it until then, not even the first pod's."""
    allocation = shared()
    other = ContainerRef("default", "other", "main")
    record = {
        MAIN: {NAMES[MEM]: list(allocation.devices[MEM])},
        other: {NAMES[CORE]: list(allocation.devices[CORE])},
    }
    holding = holders(allocation, record, NAMES)
    assert holding == {MAIN, other}
    for identity in (MAIN, other):
        problem = pod_tie_problem(identity, allocation, holding)
        assert problem is not None and "several pods (default/other, default/train)" in problem


def test_the_pods_own_allocation_is_found_when_its_env_names_another():
    """After a ledger rebuilt from kubelet's record (new IDs) or a split of two mislinked
    pods, a container's env names an ID that is gone or another pod's: the allocation
    kubelet's record gives its own pod on the card it asks for is the one it may use."""
    mine = shared()
    other = Allocation("ga-2", {MEM: (memory_device_id(GPU0, 9),)}, 1024, 100.0)
    stranger = ContainerRef("default", "other", "main")
    record = {**record_of(mine), **record_of(other, stranger)}
    allocations = [mine, other]
    assert pods_allocation(MAIN, allocations, record, NAMES, {GPU0}) == mine
    sidecar = ContainerRef("default", "train", "sidecar")
    assert pods_allocation(sidecar, allocations, record, NAMES, {GPU0}) == mine
    assert pods_allocation(MAIN, allocations, record, NAMES, {"GPU-elsewhere"}) is None
    nobody = ContainerRef("default", "gone", "main")
    assert pods_allocation(nobody, allocations, record, NAMES, {GPU0}) is None


def test_a_pod_with_two_allocations_on_the_card_gets_its_own_containers_one_or_none():
    """Two containers of one pod, each with an allocation on the card: the container named
    in kubelet's record gets its own; a container named in neither (an init container) is
    ambiguous and gets none (fail closed)."""
    first = shared(units=2, percent=0)
    second = Allocation("ga-2", {MEM: (memory_device_id(GPU0, 9),)}, 1024, 100.0)
    helper = ContainerRef("default", "train", "helper")
    record = {**record_of(first), **record_of(second, helper)}
    both = [first, second]
    assert pods_allocation(MAIN, both, record, NAMES, {GPU0}) == first
    assert pods_allocation(helper, both, record, NAMES, {GPU0}) == second
    init = ContainerRef("default", "train", "init")
    assert pods_allocation(init, both, record, NAMES, {GPU0}) is None


def test_a_pod_recreated_under_the_same_name_is_not_tied_to_the_old_ones_allocation():
    """kubelet's record names pods, not UIDs: a container of web-0 created again (a new UID,
    from its runtime's annotations) is not tied to the allocation made for the old web-0
    (its UID known from the pod cache), however the record names it. Either UID unknown,
    the name ties it as before."""
    old = replace(shared(), owner=MAIN, owner_uid="uid-old")
    holding = holders(old, record_of(old), NAMES)
    problem = pod_tie_problem(MAIN, old, holding, pod_uid="uid-new")
    assert problem is not None
    assert "allocation ga-1" in problem and "uid-old" in problem and "uid-new" in problem
    assert pod_tie_problem(MAIN, old, holding, pod_uid="uid-old") is None
    assert pod_tie_problem(MAIN, old, holding, pod_uid=None) is None
    assert pod_tie_problem(MAIN, replace(old, owner_uid=None), holding, "uid-new") is None


def test_a_recreated_pods_container_is_never_given_the_old_pods_allocation():
    """Its env's ID stale, the pod's own allocation is looked for on its card: one made for
    the old pod of its name (another known UID) is never it, even when a record read
    before kubelet let the old pod go gives it to that name; the new pod's own is."""
    old = replace(shared(units=2, percent=0), owner=MAIN, owner_uid="uid-old")
    new = Allocation("ga-2", {MEM: (memory_device_id(GPU0, 9),)}, 1024, 100.0, owner=MAIN,
                     owner_uid="uid-new")  # fmt: skip
    record = {MAIN: {NAMES[MEM]: [*old.devices[MEM], *new.devices[MEM]]}}
    both = [old, new]
    assert pods_allocation(MAIN, both, record, NAMES, {GPU0}, pod_uid="uid-new") == new
    assert pods_allocation(MAIN, [old], record, NAMES, {GPU0}, pod_uid="uid-new") is None
    assert pods_allocation(MAIN, [old], record, NAMES, {GPU0}, pod_uid="uid-old") == old
    assert pods_allocation(MAIN, both, record, NAMES, {GPU0}) is None  # no UID: ambiguous


CRIO_KEYS = {
    "io.kubernetes.pod.namespace": "default",
    "io.kubernetes.pod.name": "train",
    "io.kubernetes.container.name": "main",
}
CLAIMED = {"namespace": "default", "pod": "train", "container": "main"}


def test_the_identity_is_read_again_from_the_annotations():
    """The runtime's keys give the ContainerRef when the hook read the same."""
    assert runtime_identity(CRIO_KEYS, "cri-o", CLAIMED) == (MAIN, None)
    assert runtime_identity({}, "cri-o", {}) == (None, None)


def test_annotations_naming_two_pods_give_no_identity_and_say_why():
    forged = {**CRIO_KEYS, "io.kubernetes.cri.sandbox-name": "victim"}
    identity, problem = runtime_identity(forged, "cri-o", {})
    assert identity is None
    assert problem.startswith("its annotations name two pods: CRI-O")
    assert "default/train/main" in problem and "?/victim/?" in problem


def test_a_hook_reading_another_identity_is_not_believed():
    """The hook says victim, its annotations say train: no identity, and why."""
    identity, problem = runtime_identity(CRIO_KEYS, "cri-o", {**CLAIMED, "pod": "victim"})
    assert identity is None
    assert problem.startswith(
        "the hook read the pod identity default/victim/main from annotations that give "
        "default/train/main"
    )


# --- DRA claims: tied through the record's dynamic_resources part ---------------------


def claimed(share_id="s-1"):
    from nodemgr.domain.model import ClaimRef, ClaimResult

    ref = ClaimRef("u1", "ml", "c1", (ClaimResult("gpu", "node-a", GPU0.lower(), share_id),))
    return replace(shared(), claim=ref)


def claim_record(ref, namespace="ml", name="c1", share="s-1", device=None):
    from nodemgr.domain.podtie import CLAIMS_RECORD, claim_record_id

    device = device or GPU0.lower()
    return {ref: {CLAIMS_RECORD: [claim_record_id(namespace, name, "node-a", device, share)]}}


@pytest.mark.parametrize("share", ["s-1", ""])
def test_a_claims_container_is_held_by_its_claim_device_not_its_device_ids(share):
    """A claim's holders are the containers kubelet lists with its device (share ID equal,
    or none reported: kubelet before 1.35); its memory IDs under the device plugin's names
    are not the claim's."""
    allocation = claimed()
    assert holders(allocation, claim_record(MAIN, share=share), NAMES) == {MAIN}
    assert holders(allocation, record_of(allocation), NAMES) == set()


@pytest.mark.parametrize(
    "changes",
    [{"share": "s-2"}, {"name": "c2"}, {"namespace": "other"}, {"device": "gpu-x"}],
)
def test_another_claim_or_share_does_not_hold_it(changes):
    """Another share of the card, another claim (name or namespace), another device."""
    assert holders(claimed(), claim_record(MAIN, **changes), NAMES) == set()


def test_a_claim_shared_by_two_pods_ties_both_and_no_third():
    """A claim reserved for two pods: each pod's containers are tied; a third pod is not."""
    allocation = claimed()
    other = ContainerRef("default", "eval", "main")
    record = claim_record(MAIN) | claim_record(other)
    holding = holders(allocation, record, NAMES)
    assert pod_tie_problem(MAIN, allocation, holding) is None
    assert pod_tie_problem(other, allocation, holding) is None
    assert "not to pod default/third" in pod_tie_problem(
        ContainerRef("default", "third", "main"), allocation, holding
    )
