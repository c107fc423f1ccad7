"""Which container kubelet is admitting (nodemgr.domain.podmatch, pure).

Pins: the match is by one container's request (not the pod total), oldest pod first
(extender assume time, else creation), containers in order; a container already holding
part of its demand comes first; finished, deleting and non-pending pods are no
candidates; the extender's card comes from the pod's believed choice (here the
annotations as ``placement_trust: annotations`` reads them: the per-container allocation
annotation, else ALIYUN_COM_GPU_MEM_IDX, and garbage there counts as not said), and a
pod without one has none; what (resource, size) pairs a pod asks (the pod cache's index
key), the match over only the pods asking that pair equalling the match over all, and
the admission time computed once per PodInfo without changing its equality.
"""

from __future__ import annotations

import dataclasses

import hypothesis
from hypothesis import strategies as st

from nodemgr.domain.extenderchoice import choice_from_annotations
from nodemgr.domain.podmatch import (
    ASSUME_TIME_ANNOTATION,
    ContainerRequest,
    PodInfo,
    asked_sizes,
    find_demand,
    is_candidate_pod,
    parse_extender_index,
)

MEM, CORE = "aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage"


def pod(
    name, *containers, created=100.0, annotations=None, phase="Pending", deleting=False, init=()
):
    return PodInfo(
        namespace="ns",
        name=name,
        uid=f"uid-{name}",
        node_name="node-a",
        phase=phase,
        created_at=created,
        deleting=deleting,
        annotations=annotations or {},
        choice=choice_from_annotations(annotations or {})[0],
        containers=tuple(ContainerRequest(n, r) for n, r in containers),
        init_containers=tuple(ContainerRequest(n, r) for n, r in init),
    )


def demand(pods, resource, size, held=None):
    return find_demand(pods, resource, size, MEM, CORE, held or {})


def test_matches_one_containers_request_not_the_pod_total():
    two = pod("two", ("a", {MEM: 4, CORE: 30}), ("b", {MEM: 2}))
    found = demand([two], MEM, 2)
    assert (found.pod, found.container, found.container_index) == ("two", "b", 1)
    assert (found.memory_units, found.core_percent, found.pod_memory_units) == (2, 0, 6)
    assert demand([two], MEM, 6) is None  # the pod total is no container's request


def test_whole_demand_known_at_the_first_resource_either_way():
    p = pod("p", ("main", {MEM: 4, CORE: 40}))
    for resource, size in ((MEM, 4), (CORE, 40)):
        found = demand([p], resource, size)
        assert (found.memory_units, found.core_percent) == (4, 40)


def test_oldest_pod_first_assume_time_before_creation():
    old = pod("old", ("main", {MEM: 4}), created=50.0)
    new = pod("new", ("main", {MEM: 4}), created=10.0, annotations={
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": str(40 * 10**9)})  # fmt: skip
    assert demand([old, new], MEM, 4).pod == "new"  # assumed at 40 s, before old's 50 s


def test_a_container_mid_admission_comes_first():
    older = pod("older", ("main", {MEM: 4, CORE: 30}), created=1.0)
    busy = pod("busy", ("main", {MEM: 2, CORE: 30}), created=2.0)
    held = {("ns", "busy", "main", "uid-busy"): frozenset({MEM})}
    assert demand([older, busy], CORE, 30, held).pod == "busy"
    # a container holding this resource already is no candidate
    held = {("ns", "older", "main", "uid-older"): frozenset({CORE})}
    assert demand([older, busy], CORE, 30, held).pod == "busy"


def test_a_pod_recreated_under_the_same_name_holds_nothing_of_the_old_ones():
    """web-0 deleted and created again (a new UID) before the ledger let the old one's
    allocation go: what the old UID holds is not the new pod's, so the new pod is matched,
    as a container holding nothing yet. What a pod of that name holds under no known UID
    (admitted without the pod cache) still counts, as does what the same UID holds."""
    web = pod("web-0", ("main", {MEM: 2, CORE: 30}))
    other = pod("other", ("main", {MEM: 2, CORE: 30}), created=200.0)  # newer
    old = {("ns", "web-0", "main", "uid-old"): frozenset({MEM, CORE})}
    found = demand([web], MEM, 2, old)
    assert (found.pod, found.pod_uid) == ("web-0", "uid-web-0")
    # Holding nothing, it is not taken for a container half-way through its admission:
    half = {**old, ("ns", "other", "main", "uid-other"): frozenset({CORE})}
    assert demand([web, other], MEM, 2, half).pod == "other"
    assert demand([web], MEM, 2, {("ns", "web-0", "main", ""): frozenset({MEM})}) is None
    assert demand([web], MEM, 2, {("ns", "web-0", "main", "uid-web-0"): frozenset({MEM})}) is None
    mid = {**old, ("ns", "web-0", "main", ""): frozenset({MEM})}
    assert demand([web, other], CORE, 30, mid).pod == "web-0"  # its own half, by name


def test_finished_and_deleting_pods_are_no_candidates():
    done = pod("done", ("main", {MEM: 4}), phase="Succeeded")
    going = pod("going", ("main", {MEM: 4}), deleting=True)
    assert demand([done, going], MEM, 4) is None
    assert not is_candidate_pod(done, (MEM, CORE))
    assert not is_candidate_pod(going, (MEM, CORE))
    assert not is_candidate_pod(pod("run", ("m", {MEM: 1}), phase="Running"), (MEM, CORE))
    assert not is_candidate_pod(pod("cpu", ("m", {"cpu": 1})), (MEM, CORE))
    assert is_candidate_pod(pod("gpu", ("m", {CORE: 10})), (MEM, CORE))


def test_extender_index_per_container_then_pod_wide():
    annotations = {
        "ALIYUN_COM_GPU_MEM_IDX": "1",
        "scheduler.framework.gpushare.allocation": '{"0": {"0": 4}, "1": {"1": 2}}',
    }
    p = pod("p", ("a", {MEM: 4}), ("b", {MEM: 2}), annotations=annotations)
    assert parse_extender_index(p, 0) == 0
    assert parse_extender_index(p, 1) == 1
    assert parse_extender_index(p, 5) == 1  # not in the per-container map: pod-wide index
    assert demand([p], MEM, 4).extender_card_index == 0


def test_a_pod_without_a_believed_choice_has_no_extender_card():
    """The annotations alone (no ``choice``: the node does not believe them) choose nothing."""
    p = pod("p", ("a", {MEM: 4}), annotations={"ALIYUN_COM_GPU_MEM_IDX": "1"})
    unbelieved = dataclasses.replace(p, choice=None)
    assert parse_extender_index(unbelieved, 0) is None
    assert demand([unbelieved], MEM, 4).extender_card_index is None


def test_garbage_extender_annotations_count_as_not_said():
    for given in (
        {"ALIYUN_COM_GPU_MEM_IDX": "x"},
        {"ALIYUN_COM_GPU_MEM_IDX": "-1"},
        {"ALIYUN_COM_GPU_MEM_IDX": "\u0663"},  # a non-ASCII digit
        {"scheduler.framework.gpushare.allocation": "not json"},
        {"scheduler.framework.gpushare.allocation": '{"0": {"a": 1}}'},
        {"scheduler.framework.gpushare.allocation": "[1, 2]"},
    ):
        assert parse_extender_index(pod("p", ("a", {MEM: 1}), annotations=given), 0) is None


# --- what a pod asks: the key of the pod cache's index ------------------------------


def test_asked_sizes_are_every_containers_positive_requests():
    """Each (resource, size) some container or init container requests, once; a zero
    request asks for nothing; the pod total is no pair of its own."""
    p = pod(
        "p",
        ("a", {MEM: 4, CORE: 30}),
        ("b", {MEM: 2, "nvidia.com/gpu": 0}),
        ("c", {MEM: 4}),
        init=[("fetch", {MEM: 1})],
    )
    assert asked_sizes(p) == frozenset({(MEM, 4), (CORE, 30), (MEM, 2), (MEM, 1)})
    assert asked_sizes(pod("empty", ("m", {}))) == frozenset()


RESOURCES = (MEM, CORE)
CONTAINER = st.dictionaries(st.sampled_from(RESOURCES), st.integers(0, 3), max_size=2)
POD = st.builds(
    lambda name, containers, init, created, assumed, phase, deleting: pod(
        name,
        *[(f"c{i}", r) for i, r in enumerate(containers)],
        init=[(f"i{i}", r) for i, r in enumerate(init)],
        created=created,
        annotations={ASSUME_TIME_ANNOTATION: str(assumed * 10**9)} if assumed else None,
        phase=phase,
        deleting=deleting,
    ),
    st.sampled_from("abcdef"),
    st.lists(CONTAINER, max_size=3),
    st.lists(CONTAINER, max_size=2),
    st.sampled_from([1.0, 2.0, 3.0]),
    st.sampled_from([0, 1, 2, 4]),
    st.sampled_from(["Pending", "Pending", "Running", "Failed"]),
    st.booleans(),
)
HELD = st.dictionaries(
    st.tuples(
        st.just("ns"),
        st.sampled_from("abcdef"),
        st.sampled_from(["c0", "c1", "i0"]),
        st.sampled_from(["", "uid-a", "uid-other"]),
    ),
    st.frozensets(st.sampled_from(RESOURCES)),
    max_size=4,
)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    pods=st.lists(POD, max_size=6, unique_by=lambda p: p.name),
    resource=st.sampled_from(RESOURCES),
    size=st.integers(1, 3),
    held=HELD,
)
def test_the_match_over_the_pods_asking_equals_the_match_over_all(pods, resource, size, held):
    """Giving find_demand only the pods whose asked_sizes hold (resource, size) (what the
    pod cache's index returns) finds exactly the demand it finds among all pods."""
    asking = [p for p in pods if (resource, size) in asked_sizes(p)]
    everything = find_demand(pods, resource, size, MEM, CORE, held)
    assert find_demand(asking, resource, size, MEM, CORE, held) == everything


def test_admission_time_is_computed_once_and_leaves_equality_alone():
    """The assume time (ns) wins over creation, garbage falls back to creation; the value
    is kept on the PodInfo (computed once) and two equal PodInfos stay equal whether or
    not one of them has computed it."""
    assumed = pod(
        "p", ("m", {MEM: 1}), created=50.0, annotations={ASSUME_TIME_ANNOTATION: "40000000000"}
    )
    assert assumed.admission_time == 40.0
    assert "admission_time" in vars(assumed)  # cached on the instance: computed once
    garbage = pod("p", ("m", {MEM: 1}), created=50.0, annotations={ASSUME_TIME_ANNOTATION: "soon"})
    assert garbage.admission_time == 50.0
    twin = pod(
        "p", ("m", {MEM: 1}), created=50.0, annotations={ASSUME_TIME_ANNOTATION: "40000000000"}
    )
    assert twin == assumed and "admission_time" not in vars(twin)
