"""What the node tells the Kubernetes API: pod annotations, node labels and annotation (pure).

Derived from the ledger and the cards, so a correction at reconcile corrects what was
published. Pod annotations follow the gpushare conventions that the scheduler extender
and ``kubectl inspect gpushare`` read (docs/gpushare-compat.md):
``ALIYUN_COM_GPU_MEM_IDX`` (the card of the pod's first GPU container),
``ALIYUN_COM_GPU_MEM_POD`` (the pod's memory units), ``ALIYUN_COM_GPU_MEM_DEV``
(units per card), ``ALIYUN_COM_GPU_MEM_ASSIGNED=true``,
``ALIYUN_COM_GPU_MEM_ASSUME_TIME`` (Unix ns of the first allocation), and for a
pod with several containers ``scheduler.framework.gpushare.allocation``
(``{"<container index>": {"<gpu index>": units}}``), since one index cannot say
where each container went. gpushare-node adds ``<label_prefix>isolation``: per
container, what the node really enforces (nodemgr.domain.isolation), as
``{"<container>": {"memory": "<level>", "compute": "<level>"}}``.

A pod's annotations come from its own allocations only (by owner UID), and only once
each of its containers holds its whole demand: kubelet allocates memory and share one
after the other, and annotations written from half a demand would stand until the next
publish.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.podmatch import (
    ALLOCATION_ANNOTATION,
    ASSIGNED_ANNOTATION,
    ASSUME_TIME_ANNOTATION,
    DEV_ANNOTATION,
    IDX_ANNOTATION,
    POD_ANNOTATION,
    ContainerRequest,
    PodInfo,
)
from nodemgr.domain.statusdoc import CardFacts

GPU_COUNT_RESOURCE = "aliyun.com/gpu-count"  # node capacity, for the gpushare extender
NODE_ANNOTATION = "gpus"  # after the label prefix: per-card totals and allocations
NODE_ANNOTATION_VERSION = 1  # its "v"
ISOLATION_ANNOTATION = "isolation"  # after the label prefix: per container, on a pod
PodKey = tuple[str, str]  # (namespace, pod)

_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def pod_annotations(
    allocations: Iterable[Allocation],
    cards: Sequence[CardFacts],
    memory_unit_mib: int,
    pods: Mapping[PodKey, PodInfo],
    *,
    memory_resource: str,
    core_resource: str,
    isolation: Mapping[str, Mapping[str, Any]] | None = None,
    label_prefix: str = "",
) -> dict[PodKey, dict[str, str]]:
    """The gpushare annotations of every pod here whose containers hold their whole
    demand; ``isolation`` adds ``<label_prefix>isolation`` where known."""
    index_of = {card.uuid: card.index for card in cards}
    units_of = {card.uuid: card.memory_mib // memory_unit_mib for card in cards}
    per_pod: dict[PodKey, list[Allocation]] = defaultdict(list)
    for allocation in allocations:
        if allocation.owner is not None and not allocation.whole and allocation.cards:
            per_pod[(allocation.owner.namespace, allocation.owner.pod)].append(allocation)
    result = {}
    for key, all_held in per_pod.items():
        pod = pods.get(key)
        if pod is None:
            continue  # its demand is not known: nothing can be told whole from half
        mine = [a for a in all_held if a.held_by(pod.namespace, pod.name, pod.uid)]
        held = _whole_demands(pod, mine, memory_resource, core_resource)
        if not held:
            continue
        order = {c.name: i for i, c in enumerate(pod.containers)}
        held.sort(key=lambda a: (order.get(_owner(a).container, len(order)), _owner(a).container))
        first_card = held[0].cards[0]
        annotations = {
            IDX_ANNOTATION: str(index_of[first_card]),
            POD_ANNOTATION: str(sum(a.memory_units for a in held)),
            DEV_ANNOTATION: str(units_of[first_card]),
            ASSIGNED_ANNOTATION: "true",
            ASSUME_TIME_ANNOTATION: str(int(min(a.created_at for a in held) * 1e9)),
        }
        if len(pod.containers) > 1:
            per_container = {
                str(order[_owner(a).container]): {str(index_of[a.cards[0]]): a.memory_units}
                for a in held
                if _owner(a).container in order
            }
            annotations[ALLOCATION_ANNOTATION] = json.dumps(per_container, separators=(",", ":"))
        levels = _isolation_levels(held, isolation or {})
        if levels:
            annotations[label_prefix + ISOLATION_ANNOTATION] = levels
        result[key] = annotations
    return result


def _whole_demands(
    pod: PodInfo, held: Sequence[Allocation], memory_resource: str, core_resource: str
) -> list[Allocation]:
    """[] while a container of the pod does not hold its whole demand yet. An init
    container is not waited for (kubelet may hand its devices on), but counts only whole."""

    def demand(container: ContainerRequest) -> tuple[int, int]:
        return (
            container.requests.get(memory_resource, 0),
            container.requests.get(core_resource, 0),
        )

    wanted = {c.name: demand(c) for c in (*pod.init_containers, *pod.containers)}
    whole = [
        a
        for a in held
        if wanted.get(_owner(a).container, (0, 0)) == (a.memory_units, a.core_percent)
        and (a.memory_units or a.core_percent)
    ]
    holding = {_owner(a).container for a in whole}
    for container in pod.containers:
        if any(demand(container)) and container.name not in holding:
            return []  # admitted half-way: published once the whole pod is
    return whole


def isolation_by_allocation(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {a["id"]: a["isolation"] for a in status["allocations"] if a.get("isolation")}


def _isolation_levels(
    held: Sequence[Allocation], isolation: Mapping[str, Mapping[str, Any]]
) -> str:
    """ "" when none is known. Levels only (they change rarely, so the pod is patched
    rarely); the reasons are in ``nodemgr status``."""
    per_container = {
        _owner(a).container: {
            "memory": str(isolation[a.id]["memory"]),
            "compute": str(isolation[a.id]["compute"]),
        }
        for a in held
        if a.id in isolation
    }
    if not per_container:
        return ""
    return json.dumps(per_container, separators=(",", ":"), sort_keys=True)


def _owner(allocation: Allocation) -> ContainerRef:
    assert allocation.owner is not None
    return allocation.owner


def node_labels(cards: Sequence[CardFacts], mps_enabled: bool) -> dict[str, str]:
    """Unknown facts give no label."""
    if not cards:
        return {}
    models = {card.name for card in cards}
    labels = {
        "gpu-count": str(len(cards)),
        "gpu-model": label_value(models.pop()) if len(models) == 1 else "mixed",
        "gpu-memory-mib": str(min(card.memory_mib for card in cards)),
    }
    capabilities: list[str | None] = [getattr(card, "compute_capability", None) for card in cards]
    known = [c for c in capabilities if c]
    if not mps_enabled:
        labels["mps-capable"] = "false"
    elif len(known) == len(capabilities):  # every card's capability is known
        # MPS memory and thread limits need Volta (7.0) or newer (docs/mps.md).
        labels["mps-capable"] = str(all(_at_least(c, (7, 0)) for c in known)).lower()
    return labels


def node_annotation(status: Mapping[str, Any]) -> str:
    by_card: dict[str, list[list[Any]]] = defaultdict(list)
    for a in status["allocations"]:
        for uuid in a["gpus"]:
            by_card[uuid].append(
                [a["namespace"], a["pod"], a["container"], a["memory_mib"], a["core_percent"]]
            )
    gpus = [
        {
            "index": g["index"],
            "uuid": g["uuid"],
            "model": g["model"],
            "mode": g["mode"],
            "healthy": g["healthy"],
            "memory_mib": g["memory_total_mib"],
            "memory_allocated_mib": g["memory_allocated_mib"],
            "core_allocated_percent": g["core_allocated_percent"],
            # [namespace, pod, container, memory_mib, core_percent]; pod null until known
            "allocations": by_card.get(g["uuid"], []),
        }
        for g in status["gpus"]
    ]
    return json.dumps({"v": NODE_ANNOTATION_VERSION, "gpus": gpus}, separators=(",", ":"))


def parse_node_annotation(text: str) -> list[dict[str, Any]]:
    """The cards of a ``<label_prefix>gpus`` annotation, sorted by index; ValueError saying
    what is wrong with it."""
    try:
        document = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep") from None
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from e
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    if document.get("v") != NODE_ANNOTATION_VERSION:
        raise ValueError(
            f"format v{document.get('v')}, this nodemgr reads v{NODE_ANNOTATION_VERSION} "
            "(a newer gpushare-node wrote it: update nodemgr)"
        )
    gpus = document.get("gpus")
    if not isinstance(gpus, list):
        raise ValueError("no gpus list")
    for gpu in gpus:
        fields = ("index", "memory_mib", "memory_allocated_mib")
        if not isinstance(gpu, dict) or not all(type(gpu.get(f)) is int for f in fields):
            raise ValueError(f"a card without {', '.join(fields)}: {json.dumps(gpu)[:80]}")
        if not isinstance(gpu.get("allocations", []), list):
            raise ValueError(f"GPU{gpu['index']}: allocations is not a list")
    return sorted(gpus, key=lambda g: int(g["index"]))


def label_value(text: str) -> str:
    value = _LABEL_VALUE_BAD.sub("-", text.strip())[:63]
    return value.strip("-_.") or "unknown"


def _at_least(capability: str, minimum: tuple[int, int]) -> bool:
    major, _, minor = capability.partition(".")
    try:
        return (int(major), int(minor or 0)) >= minimum
    except ValueError:
        return False
