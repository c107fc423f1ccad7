"""nodemgr.extender.cache: each node's cards from its annotation, its pods and assumed
binds.

Pins: the card loads come from the node's gpushare annotation; a bound pod whose
containers the annotation does not list yet is counted on the card the extender's signed
placement chose (else where the policy puts it: also when its placement is unsigned,
signed for another pod or unreadable, which is reported once, or when its annotations
are hostile, which never stops the LIST or the watch), and no longer once the annotation
lists them (never twice); finished pods and pods asking no GPU count for nothing;
pending whole cards reserve the lowest idle cards; a node without the annotation (or
with one that cannot be read) takes no GPU pod, saying why. The assume cache: an assumed
bind counts at once; the pod watch showing the pod bound confirms it (counted once, by
the pod); DELETED and forget drop it; once bound it expires after the TTL unless
confirmed; a relist confirms those the list shows bound."""

from __future__ import annotations

from nodemgr.extender import logic
from nodemgr.kubernetes.podwatch import pod_info
from tests.unit.extender.support import (
    CORE,
    MEMORY,
    RESOURCES,
    WHOLE,
    Clock,
    annotation,
    cache_with,
    node,
    placed,
    pod,
)

IDX = "ALIYUN_COM_GPU_MEM_IDX"
ALLOC = "scheduler.framework.gpushare.allocation"


def free(cache, name):
    """(GiB, %) free per card, with the reason for an unavailable card."""
    with cache.lock:
        return [
            (c.memory_units_free, c.core_percent_free, c.unavailable_reason)
            for c in cache.view(name).loads
        ]


def test_cards_come_from_the_node_annotation():
    cache = cache_with([node("a", annotation((7, 80), (11, 10)))])
    assert free(cache, "a") == [(8, 20, ""), (4, 90, "")]
    assert cache.counts() == {"nodes": 1, "gpu_nodes": 1, "pods": 0, "assumed": 0}


def test_whole_and_unhealthy_cards_take_no_shared_work():
    cache = cache_with([node("a", annotation((0, 0), (0, 0), (0, 0), whole=[0], unhealthy=[1]))])
    assert [r for _, _, r in free(cache, "a")] == [
        "given out whole",
        "unhealthy (see nodemgr status on the node)",
        "",
    ]
    with cache.lock:
        assert cache.view("a").idle == (2,)


def test_nodes_without_a_usable_annotation_say_why():
    cache = cache_with([node("cpu"), node("new", '{"v": 2, "gpus": []}')])
    with cache.lock:
        assert cache.view("cpu").problem == (
            "cpu has no gpushare.aliyun.com/gpus annotation: gpushare-node does not run there, "
            "or has not published its GPUs yet"
        )
        assert (
            "unreadable gpushare.aliyun.com/gpus annotation: format v2" in cache.view("new").problem
        )
        assert "not in the extender's node cache" in cache.view("gone").problem


def test_a_bound_pod_counts_on_its_chosen_card_until_the_annotation_lists_it():
    bound = pod(
        "job",
        ("main", {MEMORY: 6, CORE: 40}),
        node_name="a",
        uid="u-job",
        annotations=placed("u-job", "a", {0: 1}),
    )
    cache = cache_with([node("a", annotation((0, 0), (0, 0)))], [bound])
    assert free(cache, "a") == [(15, 100, ""), (9, 60, "")]
    # The daemon admitted it and published: the annotation counts it, the pod no longer.
    listed = annotation((0, 0), (6, 40), allocations={1: [["default", "job", "main", 6144, 40]]})
    cache.node_handler.apply("MODIFIED", node("a", listed))
    assert free(cache, "a") == [(15, 100, ""), (9, 60, "")]
    # It finished: the daemon still holds it until kubelet lets go; then the annotation drops it.
    done = dict(bound, status={"phase": "Succeeded"})
    cache.pod_handler.apply("MODIFIED", done)
    assert free(cache, "a") == [(15, 100, ""), (9, 60, "")]
    cache.node_handler.apply("MODIFIED", node("a", annotation((0, 0), (0, 0))))
    assert free(cache, "a") == [(15, 100, ""), (15, 100, "")]


def test_a_bound_pod_without_a_card_choice_goes_where_the_policy_puts_it():
    cache = cache_with(
        [node("a", annotation((10, 0), (0, 0)))],
        [pod("p", ("main", {MEMORY: 4}), node_name="a")],
    )
    assert free(cache, "a") == [(1, 100, ""), (15, 100, "")]  # binpack: the fuller card


def test_pods_without_gpus_or_not_bound_or_finished_count_for_nothing():
    cache = cache_with(
        [node("a", annotation((0, 0)))],
        [
            pod("cpu", ("main", {"cpu": 1})),
            pod("pending", ("main", {MEMORY: 4})),
            pod("failed", ("main", {MEMORY: 4}), node_name="a", phase="Failed"),
        ],
    )
    assert free(cache, "a") == [(15, 100, "")]
    assert cache.counts()["pods"] == 2  # the GPU pods are kept (bind needs the pending one)


def test_pending_whole_cards_reserve_the_lowest_idle_cards():
    cache = cache_with(
        [node("a", annotation((2, 10), (0, 0), (0, 0)))],
        [pod("w", ("main", {WHOLE: 1}), node_name="a")],
    )
    assert [r for _, _, r in free(cache, "a")] == ["", logic.RESERVED_FOR_WHOLE, ""]
    with cache.lock:
        assert cache.view("a").idle == (2,)


def placement(cache, p, node_name):
    demand = logic.pod_demand(_info(p), RESOURCES)
    with cache.lock:
        chosen = logic.place(demand, cache.view(node_name), cache.policy, 1024)
        cache.assume(chosen, demand)
    return demand, chosen


def _info(p):
    return pod_info(p)


def test_an_assumed_bind_counts_at_once_and_the_watch_confirms_it_without_a_gap():
    new = pod("job", ("main", {MEMORY: 6, CORE: 40}), uid="u-job")
    cache = cache_with([node("a", annotation((0, 0), (0, 0)))], [new])
    demand, chosen = placement(cache, new, "a")
    assert chosen.cards == {0: 0}
    assert free(cache, "a")[0] == (9, 60, "")
    cache.bound(demand.uid)
    # The patch of the annotations shows first (not bound yet): still assumed.
    patched = dict(new, metadata={**new["metadata"], "annotations": placed("u-job", "a", {0: 0})})
    cache.pod_handler.apply("MODIFIED", patched)
    assert cache.is_assumed("u-job") and free(cache, "a")[0] == (9, 60, "")
    # Then the Binding: the pod counts itself, the assumption is gone, counted once.
    bound = dict(patched, spec={**patched["spec"], "nodeName": "a"})
    cache.pod_handler.apply("MODIFIED", bound)
    assert not cache.is_assumed("u-job") and cache.confirmed_total == 1
    assert free(cache, "a")[0] == (9, 60, "")


def test_forget_delete_and_expiry_free_an_assumption():
    clock = Clock()
    pods = [pod(f"p{i}", ("main", {MEMORY: 4}), uid=f"u{i}") for i in range(3)]
    cache = cache_with([node("a", annotation((0, 0)))], pods, clock=clock, ttl=30)
    for p in pods:
        placement(cache, p, "a")
    assert free(cache, "a") == [(3, 100, "")]
    cache.forget("u0")
    cache.pod_handler.apply("DELETED", pods[1])
    assert free(cache, "a") == [(11, 100, "")]
    clock.now += 1000
    assert cache.expire() == 0  # not bound yet: a bind in flight never expires
    cache.bound("u2")
    clock.now += 29
    assert cache.expire() == 0
    clock.now += 2
    assert cache.expire() == 1 and cache.expired_total == 1
    assert free(cache, "a") == [(15, 100, "")]


def test_a_relist_confirms_the_assumptions_it_shows_bound():
    new = pod("job", ("main", {MEMORY: 6}), uid="u-job")
    cache = cache_with([node("a", annotation((0, 0)))], [new])
    demand, _ = placement(cache, new, "a")
    bound = dict(new, spec={**new["spec"], "nodeName": "a"})
    bound["metadata"] = {**new["metadata"], "annotations": placed("u-job", "a", {0: 0})}
    cache.pod_handler.replace(iter([bound]))
    assert not cache.is_assumed(demand.uid)
    assert free(cache, "a") == [(9, 100, "")]


def test_bind_finds_the_pod_from_the_watch_or_from_a_filter_call():
    known = pod("known", ("main", {MEMORY: 1}), uid="u-known")
    cache = cache_with([node("a", annotation((0, 0)))], [known])
    with cache.lock:
        assert cache.demand_for_bind("default", "known", "u-known").name == "known"
        assert cache.demand_for_bind("default", "known", "other-uid") is None
        assert cache.demand_for_bind("default", "fresh", "u-fresh") is None
    fresh = logic.pod_demand(_info(pod("fresh", ("main", {MEMORY: 1}), uid="u-fresh")), RESOURCES)
    cache.remember(fresh)
    with cache.lock:
        assert cache.demand_for_bind("default", "fresh", "u-fresh") == fresh


def test_an_unbelieved_placement_counts_where_the_policy_puts_it_and_is_reported_once():
    """A pod owner's IDX=1 (unsigned), a placement signed for another pod, or one signed
    by another key: the pod counts on binpack's card (GPU0, the fuller), not GPU1, and
    each is reported once (the same reason again is not reported twice)."""
    reported = []
    owner = pod(
        "owner", ("main", {MEMORY: 4}), node_name="a", uid="u-owner",
        annotations={IDX: "1", ALLOC: '{"0":{"1":4}}', "ALIYUN_COM_GPU_MEM_ASSIGNED": "false"},
    )  # fmt: skip
    copied = pod(
        "copied", ("main", {MEMORY: 1}), node_name="a", uid="u-copied",
        annotations=placed("u-other", "a", {0: 1}),
    )  # fmt: skip
    cache = cache_with(
        [node("a", annotation((2, 0), (0, 0)))],
        [owner, copied],
        on_ignored=lambda *args: reported.append(args),
    )
    assert free(cache, "a") == [(8, 100, ""), (15, 100, "")]
    assert [(ns, name, uid) for ns, name, uid, _ in reported] == [
        ("default", "owner", "u-owner"),
        ("default", "copied", "u-copied"),
    ]
    assert "are not signed by the scheduler extender" in reported[0][3]
    assert "was signed for pod UID u-other, not this pod's u-copied" in reported[1][3]
    cache.pod_handler.apply("MODIFIED", owner)
    assert len(reported) == 2


NESTED = "[" * 3000 + "]" * 3000


def test_hostile_annotations_never_stop_the_list_or_the_watch():
    """A tenant's pod with the allocation annotation nested 3,000 deep and a 5,000-digit
    assume time: the LIST syncs the cache (healthz would say 200), the pod counts where
    the policy puts it, and a later event of such a pod changes nothing else."""
    hostile = pod(
        "nested", ("main", {MEMORY: 4}), node_name="a", uid="u-nested",
        annotations={ALLOC: NESTED, "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1" * 5000, IDX: "1"},
    )  # fmt: skip
    cache = cache_with([node("a", annotation((2, 0), (0, 0)))], [hostile])
    assert cache.synced and cache.counts()["pods"] == 1
    assert free(cache, "a") == [(9, 100, ""), (15, 100, "")]
    again = pod("nested-2", ("main", {MEMORY: 1}), node_name="a", uid="u-n2",
                annotations={ALLOC: NESTED})  # fmt: skip
    cache.pod_handler.apply("ADDED", again)
    assert cache.counts()["pods"] == 2


def test_a_pod_the_handler_cannot_read_is_left_out_and_reported():
    """Whatever else one pod holds, it is skipped with a report, never the whole LIST."""
    reported = []
    broken = pod("broken", ("main", {MEMORY: 1}), uid="u-broken")
    broken["spec"]["containers"] = ["not a container"]  # no API server sends it: a bug's stand-in
    good = pod("good", ("main", {MEMORY: 1}), node_name="a", uid="u-good")
    cache = cache_with(
        [node("a", annotation((0, 0)))], [broken, good], on_ignored=lambda *a: reported.append(a)
    )
    assert cache.synced and cache.counts()["pods"] == 1
    assert reported and reported[0][:3] == ("default", "broken", "u-broken")
    assert "gpushare-scheduler cannot read this pod (AttributeError" in reported[0][3]


def test_a_node_annotation_nested_too_deep_never_stops_the_list():
    """Any holder of node patch rights can write a node's gpus annotation: one nested
    3,000 deep, or with a card the handler cannot read, leaves that node without GPUs
    (saying why) and the LIST synced."""
    nested = node("nested", "[" * 3000 + "]" * 3000)
    text = annotation((0, 0))
    broken = node(
        "broken", text.replace('"core_allocated_percent": 0', '"core_allocated_percent": "lots"')
    )
    cache = cache_with([nested, broken, node("a", annotation((0, 0)))])
    assert cache.synced and cache.counts()["gpu_nodes"] == 1
    with cache.lock:
        assert "unreadable gpushare.aliyun.com/gpus annotation: nested too deep" in (
            cache.view("nested").problem
        )
        assert cache.view("broken").problem.startswith("broken: unreadable node (ValueError")
