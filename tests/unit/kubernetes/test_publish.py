"""What the node publishes to the Kubernetes API (nodemgr.kubernetes.publish, pure).

Pins: the gpushare annotations `kubectl inspect gpushare` and the extender
read (index of the pod's first GPU container, pod units, units per card,
ASSIGNED=true, assume time from the first allocation) and, for multi-container
pods, the per-container allocation JSON; pods without a known owner or with
whole cards get none; a pod gets them only once each of its GPU containers holds
its whole demand (kubelet allocates a container's two resources one at a time),
and not while the pod is unknown; node labels by model/count/memory/MPS (unknown
capability gives no mps-capable label); label values are valid; the node
annotation is compact JSON per card with its allocations; with the status
document's isolation, ``<label_prefix>isolation`` gives each container's levels.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.isolation import NodeIsolationFacts, WatchdogFacts
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.podmatch import ContainerRequest, PodInfo
from nodemgr.domain.statusdoc import MpsView, build_status
from nodemgr.kubernetes.publish import (
    isolation_by_allocation,
    label_value,
    node_annotation,
    node_labels,
    pod_annotations,
)
from standins.cards import GPU0, GPU1

CARDS = [
    SimpleNamespace(
        index=0, uuid=GPU0, name="Tesla T4", memory_mib=15360, compute_capability="7.5"
    ),
    SimpleNamespace(
        index=1, uuid=GPU1, name="Tesla T4", memory_mib=15360, compute_capability="7.5"
    ),
]


def shared(aid, card, units, core, ref, created=10.0):
    devices = {ResourceKind.MEMORY: tuple(f"{card}-_-{j}" for j in range(units))}
    if core:
        devices[ResourceKind.CORE] = tuple(f"{card}-_-c{j}" for j in range(core))
    return Allocation(aid, devices, units * 1024, created_at=created, owner=ref)


MEMORY, CORE = "aliyun.com/gpu-mem", "aliyun.com/gpu-core.percentage"
RESOURCES = {"memory_resource": MEMORY, "core_resource": CORE}


def pod(name, *containers, init=()):
    """A pod of this node; each container ``(name, memory units, core percent)``."""

    def requests(units, core):
        return {r: n for r, n in ((MEMORY, units), (CORE, core)) if n}

    return PodInfo(
        "ns", name, "uid", "node-a", "Pending", 0.0, False, {},
        tuple(ContainerRequest(c, requests(u, k)) for c, u, k in containers),
        tuple(ContainerRequest(c, requests(u, k)) for c, u, k in init),
    )  # fmt: skip


def annotations_of(allocations, pods, **kwargs):
    return pod_annotations(allocations, CARDS, 1024, pods, **RESOURCES, **kwargs)


def test_single_container_pod():
    ref = ContainerRef("ns", "job", "main")
    pods = {("ns", "job"): pod("job", ("main", 4, 30))}
    published = annotations_of([shared("a1", GPU1, 4, 30, ref)], pods)
    assert published == {
        ("ns", "job"): {
            "ALIYUN_COM_GPU_MEM_IDX": "1",
            "ALIYUN_COM_GPU_MEM_POD": "4",
            "ALIYUN_COM_GPU_MEM_DEV": "15",
            "ALIYUN_COM_GPU_MEM_ASSIGNED": "true",
            "ALIYUN_COM_GPU_MEM_ASSUME_TIME": str(10 * 10**9),
        }
    }


def test_multi_container_pod_says_where_each_container_went():
    allocations = [
        shared("b", GPU0, 2, 0, ContainerRef("ns", "two", "side"), created=12.0),
        shared("a", GPU1, 4, 0, ContainerRef("ns", "two", "main"), created=11.0),
    ]
    published = annotations_of(
        allocations, {("ns", "two"): pod("two", ("main", 4, 0), ("side", 2, 0))}
    )
    annotations = published[("ns", "two")]
    assert annotations["ALIYUN_COM_GPU_MEM_IDX"] == "1"  # the first container's card
    assert annotations["ALIYUN_COM_GPU_MEM_POD"] == "6"
    assert annotations["ALIYUN_COM_GPU_MEM_ASSUME_TIME"] == str(11 * 10**9)
    assert json.loads(annotations["scheduler.framework.gpushare.allocation"]) == {
        "0": {"1": 4},
        "1": {"0": 2},
    }


def test_no_annotations_without_owner_or_for_whole_cards():
    whole = Allocation("w", {ResourceKind.WHOLE: (GPU0,)}, 0, 1.0, ContainerRef("ns", "w", "m"))
    unknown = shared("u", GPU1, 1, 0, None)
    pods = {("ns", "w"): pod("w", ("m", 0, 0))}
    assert annotations_of([whole, unknown], pods) == {}


def test_half_of_a_containers_demand_publishes_nothing():
    """kubelet allocates a container's memory and share one after the other, in either
    order: while its allocation holds only one of them, the pod gets no annotation at all
    (no isolation saying memory or compute "unlimited", no ALIYUN_COM_GPU_MEM_POD of 0);
    once it holds both, everything, from the whole demand."""
    ref = ContainerRef("ns", "job", "main")
    pods = {("ns", "job"): pod("job", ("main", 4, 30))}
    core_only = Allocation(
        "a1", {ResourceKind.CORE: tuple(f"{GPU1}-_-c{j}" for j in range(30))}, 0, 10.0, ref
    )
    memory_only = shared("a1", GPU1, 4, 0, ref)
    whole_demand = shared("a1", GPU1, 4, 30, ref)
    watchdog = WatchdogFacts(running=True, action="kill", usage_readable=True)
    for held in (core_only, memory_only, whole_demand):
        status = build_status(
            "node-a", CARDS, [held], source="daemon", card_problems={},
            mps={GPU0: MpsView("healthy", 2), GPU1: MpsView("healthy", 2)}, usage=None,
            containers={}, violations={}, enforcement=None, daemon=None,
            isolation=NodeIsolationFacts(watchdog),
        )  # fmt: skip
        published = annotations_of(
            [held], pods, isolation=isolation_by_allocation(status), label_prefix="p/"
        )
        if held is not whole_demand:
            assert published == {}, held.devices.keys()
    assert published[("ns", "job")]["ALIYUN_COM_GPU_MEM_POD"] == "4"
    assert json.loads(published[("ns", "job")]["p/isolation"]) == {
        "main": {"memory": "enforced", "compute": "advisory"}
    }


def test_a_pod_is_published_once_every_gpu_container_holds_its_demand():
    """A pod of two GPU containers gets its annotations once both hold their whole demand
    (not with the first container alone: ALIYUN_COM_GPU_MEM_POD would be half the pod's);
    a container asking no GPU is not waited for, nor is an init container. A pod not (yet)
    in the pod cache gets nothing: its demand is not known."""
    main = shared("a", GPU1, 4, 0, ContainerRef("ns", "two", "main"), created=11.0)
    side = shared("b", GPU0, 2, 0, ContainerRef("ns", "two", "side"), created=12.0)
    pods = {
        ("ns", "two"): pod(
            "two", ("main", 4, 0), ("side", 2, 0), ("plain", 0, 0), init=[("setup", 1, 0)]
        )
    }
    assert annotations_of([main], pods) == {}
    assert annotations_of([main, side], pods)[("ns", "two")]["ALIYUN_COM_GPU_MEM_POD"] == "6"
    assert annotations_of([main, side], {}) == {}


def test_a_pod_recreated_under_its_name_is_published_from_its_own_allocation_only():
    """web-0 deleted and created again (a new UID) holds its allocation while the old
    one's is not released yet (same name, same container): the pod's annotations count
    its own (pod total 4, on GPU1), not both (8), nor the old one's card."""
    ref = ContainerRef("ns", "web-0", "main")
    old = replace(shared("old", GPU0, 4, 30, ref, created=5.0), owner_uid="uid-old")
    new = replace(shared("new", GPU1, 4, 30, ref, created=10.0), owner_uid="uid")
    pods = {("ns", "web-0"): pod("web-0", ("main", 4, 30))}  # the cache: the new one
    published = annotations_of([old, new], pods)[("ns", "web-0")]
    assert published["ALIYUN_COM_GPU_MEM_POD"] == "4"
    assert published["ALIYUN_COM_GPU_MEM_IDX"] == "1"
    assert published["ALIYUN_COM_GPU_MEM_ASSUME_TIME"] == str(10 * 10**9)
    # Only the old one's allocation, the new pod not admitted yet: nothing for the new pod.
    assert annotations_of([old], pods) == {}
    # An allocation of unknown UID (admitted without the pod cache) is taken by name.
    unknown = replace(new, owner_uid=None)
    assert annotations_of([unknown], pods)[("ns", "web-0")]["ALIYUN_COM_GPU_MEM_IDX"] == "1"


def test_node_labels():
    assert node_labels(CARDS, mps_enabled=True) == {
        "gpu-count": "2",
        "gpu-model": "Tesla-T4",
        "gpu-memory-mib": "15360",
        "mps-capable": "true",
    }
    old = [SimpleNamespace(name="Tesla P100", memory_mib=16280, compute_capability="6.0")]
    assert node_labels(old, mps_enabled=True)["mps-capable"] == "false"
    unknown = [SimpleNamespace(name="T4", memory_mib=1, compute_capability=None)]
    assert "mps-capable" not in node_labels(unknown, mps_enabled=True)
    assert node_labels(unknown, mps_enabled=False)["mps-capable"] == "false"
    mixed = [*CARDS, SimpleNamespace(name="A100", memory_mib=81920, compute_capability="8.0")]
    assert node_labels(mixed, True)["gpu-model"] == "mixed"
    assert node_labels(mixed, True)["gpu-memory-mib"] == "15360"
    assert node_labels([], True) == {}


def test_label_values_are_valid():
    assert label_value("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert label_value("  (weird) / name  ") == "weird-name"
    assert len(label_value("x" * 100)) == 63
    assert label_value("///") == "unknown"


def test_node_annotation_is_compact_json_per_card():
    ref = ContainerRef("ns", "job", "main")
    status = build_status(
        "node-a",
        CARDS,
        [shared("a1", GPU1, 4, 30, ref)],
        source="daemon",
        card_problems={},
        mps=None,
        usage=None,
        containers={},
        violations={},
        enforcement=None,
        daemon=None,
    )
    text = node_annotation(status)
    assert " " not in text.replace("Tesla T4", "")
    gpus = json.loads(text)["gpus"]
    assert [g["memory_allocated_mib"] for g in gpus] == [0, 4096]
    assert gpus[1]["allocations"] == [["ns", "job", "main", 4096, 30]]
    assert gpus[1]["mode"] == "shared" and gpus[0]["mode"] == "idle"


def test_isolation_annotation_gives_each_containers_levels():
    """With the status document's isolation, a pod gets ``<label_prefix>isolation``: per
    container, its memory and compute levels (compact JSON, no reasons); a container
    whose isolation is not known is left out, and the gpushare keys are unchanged. Pods
    of whole cards still get nothing."""
    allocations = [
        shared("a", GPU0, 4, 30, ContainerRef("ns", "two", "main")),
        shared("b", GPU0, 2, 0, ContainerRef("ns", "two", "side")),
        shared("c", GPU0, 2, 0, ContainerRef("ns", "two", "late")),
        Allocation("w", {ResourceKind.WHOLE: (GPU1,)}, 0, 1.0, ContainerRef("ns", "w", "m")),
    ]
    watchdog = WatchdogFacts(running=True, action="kill", usage_readable=True)
    status = build_status(
        "node-a", CARDS, allocations, source="daemon", card_problems={},
        mps={GPU0: MpsView("healthy", 2), GPU1: MpsView("off")}, usage=None, containers={},
        violations={}, enforcement=None, daemon=None, isolation=NodeIsolationFacts(watchdog),
    )  # fmt: skip
    known = isolation_by_allocation(status)
    del known["c"]  # as for an allocation made after the document was taken
    pods = {("ns", "two"): pod("two", ("main", 4, 30), ("side", 2, 0), ("late", 2, 0))}
    without = annotations_of(allocations, pods)
    published = annotations_of(
        allocations, pods, isolation=known, label_prefix="gpushare.aliyun.com/"
    )
    annotations = published[("ns", "two")]
    text = annotations.pop("gpushare.aliyun.com/isolation")
    assert annotations == without[("ns", "two")]
    assert json.loads(text) == {
        "main": {"memory": "enforced", "compute": "advisory"},
        "side": {"memory": "enforced", "compute": "unlimited"},
    }
    assert " " not in text and "detail" not in text
    assert ("ns", "w") not in published
