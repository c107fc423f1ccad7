"""What the node publishes to the Kubernetes API (nodemgr.kubernetes.publish, pure).

Pins: the gpushare annotations `kubectl inspect gpushare` and the extender
read (index of the pod's first GPU container, pod units, units per card,
ASSIGNED=true, assume time from the first allocation) and, for multi-container
pods, the per-container allocation JSON; pods without a known owner or with
whole cards get none; node labels by model/count/memory/MPS (unknown
capability gives no mps-capable label); label values are valid; the node
annotation is compact JSON per card with its allocations; with the status
document's isolation, ``<label_prefix>isolation`` gives each container's levels.
"""

from __future__ import annotations

import json
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
from tests.harness.cards import GPU0, GPU1

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


def pod(name, *containers):
    return PodInfo("ns", name, "uid", "node-a", "Pending", 0.0, False, {},
                   tuple(ContainerRequest(c, {}) for c in containers))  # fmt: skip


def test_single_container_pod():
    ref = ContainerRef("ns", "job", "main")
    published = pod_annotations([shared("a1", GPU1, 4, 30, ref)], CARDS, 1024, {})
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
    published = pod_annotations(
        allocations, CARDS, 1024, {("ns", "two"): pod("two", "main", "side")}
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
    assert pod_annotations([whole, unknown], CARDS, 1024, {}) == {}


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
    pods = {("ns", "two"): pod("two", "main", "side", "late")}
    without = pod_annotations(allocations, CARDS, 1024, pods)
    published = pod_annotations(
        allocations, CARDS, 1024, pods, isolation=known, label_prefix="gpushare.aliyun.com/"
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
