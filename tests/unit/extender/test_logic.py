"""nodemgr.extender.logic: filter, prioritize and bind's card choice, on the node's arithmetic.

Pins: a node passes only if each container's memory and share fit on one card, and
the reason otherwise names every card (the issue's example, word for word); several
containers are placed one after another, each reducing its card; whole cards come from
the idle cards (lowest index first, as the daemon gives them) and are not used for the
same pod's shared containers; init containers share the pod-wide card; unresolvable
(preemption cannot help) only when no card could hold the container even empty or the
node has no gpushare-node; binpack scores the node the pod fills most highest, spread
the emptiest; the bind annotations are those the node daemon honours
(nodemgr.domain.podmatch parses them back to the chosen cards).
"""

from __future__ import annotations

import json

import pytest

from nodemgr.allocation.admission import place_demand
from nodemgr.domain.extenderchoice import decide
from nodemgr.domain.placement import CardLoad, NoFitDescriber
from nodemgr.domain.podmatch import ContainerRequest, PodInfo, find_demand, parse_extender_index
from nodemgr.extender import logic
from nodemgr.extender.logic import ContainerDemand, NodeView, PodDemand, Unfit
from tests.unit.extender.support import CORE, MEMORY, RESOURCES, TRUST, WHOLE, placed


def card(index, free_gib, free_core, total_gib=15, reason=""):
    return CardLoad(index, f"GPU-{index}", "Tesla T4", total_gib, free_gib, free_core, reason)


def view(name, *cards, idle=None):
    loads = tuple(card(i, *c) for i, c in enumerate(cards))
    if idle is None:
        idle = tuple(
            c.index for c in loads if c.memory_units_free == 15 and c.core_percent_free == 100
        )
    return NodeView(name, loads, tuple(idle))


def demand(*containers, init=()):
    """Containers as (name, memory, core[, whole])."""
    parts = [
        ContainerDemand(-1 - i, n, *rest, *(0,) * (3 - len(rest)))
        for i, (n, *rest) in enumerate(init)
    ]
    parts += [
        ContainerDemand(i, n, *rest, *(0,) * (3 - len(rest)))
        for i, (n, *rest) in enumerate(containers)
    ]
    return PodDemand("ml", "job", "uid-1", tuple(parts))


ISSUE_NODE = view("node-a", (8, 20), (4, 90))


def test_the_issues_example_fails_with_every_card_named():
    with pytest.raises(Unfit) as failure:
        logic.fits(demand(("main", 6, 40)), ISSUE_NODE, "binpack", 1024)
    assert failure.value.reason == (
        "no single GPU on node-a has 6 GiB and 40% free: GPU0 (Tesla T4) has 8 GiB/20% free, "
        "GPU1 (Tesla T4) has 4 GiB/90% free"
    )
    assert not failure.value.unresolvable  # freeing a card (preemption) would help


def test_filter_splits_passing_failing_and_unresolvable_nodes():
    views = {
        "node-a": ISSUE_NODE,
        "node-b": view("node-b", (15, 100), (15, 100)),
        "node-c": NodeView(
            "node-c", (), problem="node-c has no gpushare.aliyun.com/gpus annotation"
        ),
        "node-d": view("node-d", (6, 30), (6, 100)),
    }
    outcome = logic.filter_nodes(demand(("main", 6, 40)), views, views.__getitem__, "binpack", 1024)
    assert outcome.passed == ["node-b", "node-d"]
    assert set(outcome.failed) == {"node-a"}
    assert outcome.unresolvable == {"node-c": "node-c has no gpushare.aliyun.com/gpus annotation"}


def test_a_container_larger_than_any_card_is_unresolvable():
    with pytest.raises(Unfit) as failure:
        logic.place(demand(("main", 16, 0)), view("n", (15, 100), (15, 100)), "binpack", 1024)
    assert failure.value.unresolvable
    assert failure.value.reason.startswith("no single GPU on n has 16 GiB free: GPU0")


def test_containers_are_placed_one_after_another_each_on_one_card():
    node = view("n", (15, 100), (15, 100))
    placement = logic.place(demand(("a", 8, 30), ("b", 8, 30)), node, "binpack", 1024)
    assert placement.cards == {0: 0, 1: 1}  # 8 + 8 GiB do not fit one 15 GiB card
    assert placement.index == 0
    with pytest.raises(Unfit) as failure:
        logic.place(demand(("a", 8, 0), ("b", 8, 0), ("c", 8, 0)), node, "binpack", 1024)
    assert failure.value.reason.startswith("container c: no single GPU on n has 8 GiB free: GPU0")
    assert "GPU0 (Tesla T4) has 7 GiB/100% free, GPU1 (Tesla T4) has 7 GiB/100% free" in (
        failure.value.reason
    )


def test_binpack_and_spread_pick_cards_as_the_node_does():
    node = view("n", (10, 100), (4, 100))
    assert logic.place(demand(("m", 3, 10)), node, "binpack", 1024).cards == {0: 1}
    assert logic.place(demand(("m", 3, 10)), node, "spread", 1024).cards == {0: 0}


def test_whole_cards_come_from_idle_cards_lowest_first_and_not_for_shared_work():
    node = view("n", (15, 100), (12, 50), (15, 100), (15, 100))
    placement = logic.place(demand(("gpu", 0, 0, 2), ("side", 1, 10)), node, "binpack", 1024)
    assert placement.whole_cards == (0, 2)
    assert placement.cards == {1: 1}  # the shared container: on the busy card, not a taken one
    placement = logic.place(demand(("gpu", 0, 0, 3), ("side", 12, 50)), node, "binpack", 1024)
    assert placement.whole_cards == (0, 2, 3) and placement.cards == {1: 1}
    with pytest.raises(Unfit) as failure:  # would need an idle card the whole part takes
        logic.place(demand(("gpu", 0, 0, 3), ("side", 13, 0)), node, "binpack", 1024)
    assert "GPU0 (Tesla T4) has none (to be given out whole)" in failure.value.reason
    assert not failure.value.unresolvable


def test_not_enough_idle_cards_says_which_are_busy():
    node = view("n", (12, 50), (15, 100), (0, 0, 15, "given out whole"))
    with pytest.raises(Unfit) as failure:
        logic.place(demand(("gpu", 0, 0, 2)), node, "binpack", 1024)
    assert failure.value.reason == (
        "n has 1 of 3 GPUs free to give out whole, the pod needs 2 whole GPUs: GPU0 holds "
        "shared work, GPU1 free, GPU2 given out whole"
    )
    assert not failure.value.unresolvable
    with pytest.raises(Unfit) as failure:
        logic.place(demand(("gpu", 0, 0, 4)), node, "binpack", 1024)
    assert failure.value.unresolvable  # more than the node has


def test_init_containers_go_together_on_the_pod_wide_card():
    node = view("n", (10, 100), (4, 100))
    placement = logic.place(
        demand(("main", 5, 20), init=[("setup", 2, 10), ("warm", 1, 10)]), node, "binpack", 1024
    )
    assert placement.cards[-1] == placement.cards[-2] == placement.index == 1  # 3 GiB: fullest
    assert placement.cards[0] == 0


def test_scores_binpack_prefers_the_fuller_node_and_spread_the_emptier():
    views = {"full": view("full", (4, 60), (15, 100)), "empty": view("empty", (15, 100), (15, 100))}
    pod = demand(("m", 3, 20))
    binpack = dict(logic.prioritize(pod, views, views.__getitem__, "binpack", 1024))
    spread = dict(logic.prioritize(pod, views, views.__getitem__, "spread", 1024))
    assert binpack["full"] > binpack["empty"]
    assert spread["empty"] > spread["full"]
    assert all(0 <= s <= 10 for s in (*binpack.values(), *spread.values()))
    views["none"] = view("none", (1, 100))
    assert dict(logic.prioritize(pod, views, views.__getitem__, "binpack", 1024))["none"] == 0


def test_bind_annotations_are_what_the_node_daemon_reads_back():
    node = view("n", (15, 100), (6, 100))
    pod = demand(("a", 4, 10), ("sidecar", 0, 0), ("b", 8, 30), ("share", 0, 20))
    placement = logic.place(pod, node, "binpack", 1024)
    annotations = logic.bind_annotations(pod, placement, node, 1_700_000_000_000_000_000)
    assert annotations["ALIYUN_COM_GPU_MEM_IDX"] == "1"
    assert annotations["ALIYUN_COM_GPU_MEM_POD"] == "12"
    assert annotations["ALIYUN_COM_GPU_MEM_DEV"] == "15"
    assert annotations["ALIYUN_COM_GPU_MEM_ASSIGNED"] == "false"
    assert annotations["ALIYUN_COM_GPU_MEM_ASSUME_TIME"] == "1700000000000000000"
    per_container = json.loads(annotations["scheduler.framework.gpushare.allocation"])
    assert per_container == {"0": {"1": 4}, "2": {"0": 8}, "3": {"1": 0}}
    # What the node honours is the signed placement of the same cards (server.bind signs).
    annotations |= placed("uid-1", "n", placement.cards)
    choice, note = decide(annotations, "uid-1", "n", True, TRUST)
    info = PodInfo("ml", "job", "uid-1", "n", "Pending", 0.0, False, annotations, (), choice=choice)
    assert note == "" and [parse_extender_index(info, i) for i in (0, 2, 3)] == [1, 0, 1]
    whole_only = demand(("gpu", 0, 0, 1))
    assert (
        logic.bind_annotations(whole_only, logic.place(whole_only, node, "binpack", 1024), node, 1)
        == {}
    )


def test_pod_demand_reads_the_three_resources_per_container():
    info = PodInfo(
        "ml",
        "job",
        "u",
        "",
        "Pending",
        0.0,
        False,
        {},
        (
            ContainerRequest("main", {MEMORY: 4, CORE: 30}),
            ContainerRequest("cpu", {"example.com/foo": 1}),
            ContainerRequest("gpu", {WHOLE: 2}),
        ),
        (ContainerRequest("init", {MEMORY: 1}),),
    )
    pod = logic.pod_demand(info, RESOURCES)
    assert pod.containers == (
        ContainerDemand(-1, "init", 1, 0, 0),
        ContainerDemand(0, "main", 4, 30, 0),
        ContainerDemand(2, "gpu", 0, 0, 2),
    )
    assert pod.whole_cards == 2
    assert not logic.pod_demand(
        PodInfo("a", "b", "u", "", "Pending", 0, False, {}, ()), RESOURCES
    ).wants_gpu


def test_fits_agrees_with_place():
    node = view("n", (3, 100), (8, 20))
    for memory, core in ((3, 100), (4, 10), (8, 20), (8, 21), (9, 0), (0, 100)):
        pod = demand(("m", memory, core))
        try:
            logic.place(pod, node, "binpack", 1024)
            placed = True
        except Unfit:
            placed = False
        try:
            logic.fits(pod, node, "binpack", 1024)
            fit = True
        except Unfit:
            fit = False
        assert placed == fit, (memory, core)


def test_the_node_honours_the_chosen_card_for_share_as_for_memory():
    """Round trip: the bind annotations, read by the daemon's own match (podmatch.find_demand)
    for whichever resource kubelet allocates first, give admission.place_demand the card the
    extender chose, for memory + share and for share alone, over the node's own policy."""
    node = view("n", (15, 100), (6, 100))  # binpack alone would take GPU1
    pod = demand(("both", 4, 30), ("share", 0, 20))
    chosen = logic.place(pod, node, "spread", 1024)  # the extender ran spread: GPU0
    annotations = logic.bind_annotations(pod, chosen, node, 1) | placed("uid-1", "n", chosen.cards)
    spec = (
        ContainerRequest("both", {MEMORY: 4, CORE: 30}),
        ContainerRequest("share", {CORE: 20}),
    )
    choice, _ = decide(annotations, "uid-1", "n", True, TRUST)
    info = PodInfo(
        "ml", "job", "uid-1", "n", "Pending", 0.0, False, annotations, spec, choice=choice
    )
    describe = NoFitDescriber("n", 1024)
    for resource, size, container in ((CORE, 30, "both"), (MEMORY, 4, "both"), (CORE, 20, "share")):
        found = find_demand([info], resource, size, MEMORY, CORE, {})
        assert found is not None and found.container == container
        assert found.extender_card_index == chosen.cards[found.container_index] == 0
        assert place_demand(found, node.loads, "binpack", describe, "n") == "GPU-0"
