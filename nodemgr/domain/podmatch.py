"""Which container kubelet is admitting, from the pods bound to this node (pure, no I/O).

kubelet's GetPreferredAllocation and Allocate say how many devices of one resource it
wants, never for which pod. From the cache of pods bound here and the allocations made:

- candidates are containers of pods not deleting or finished, requesting exactly the
  size asked of the resource and not holding it yet (by pod UID where known:
  ``held_by``);
- kubelet admits pods one at a time and a pod's containers in order (init containers
  first), so the oldest pod (the extender's assume time, else creation) and its first
  such container win.

The match carries the container's whole GPU demand, so the first Allocate, whichever
resource it is for, places memory and share on one card, and the card the scheduler
extender chose (the pod's ``choice``, :mod:`nodemgr.domain.extenderchoice`). A wrong
guess between two identical pending containers is corrected by kubelet's PodResources
record at the next reconcile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from nodemgr.domain.extenderchoice import (
    ALLOCATION_ANNOTATION,
    ASSIGNED_ANNOTATION,
    ASSUME_TIME_ANNOTATION,
    IDX_ANNOTATION,
    ExtenderChoice,
)

# Annotations of the gpushare scheduler extender (see docs/gpushare-compat.md).
POD_ANNOTATION = "ALIYUN_COM_GPU_MEM_POD"
DEV_ANNOTATION = "ALIYUN_COM_GPU_MEM_DEV"
__all__ = [
    "ALLOCATION_ANNOTATION",
    "ASSIGNED_ANNOTATION",
    "ASSUME_TIME_ANNOTATION",
    "DEV_ANNOTATION",
    "IDX_ANNOTATION",
    "POD_ANNOTATION",
    "ContainerRequest",
    "Demand",
    "FINISHED_PHASES",
    "HeldByContainer",
    "PodInfo",
    "asked_sizes",
    "find_demand",
    "held_by",
    "is_candidate_pod",
    "parse_extender_index",
]

FINISHED_PHASES = ("Succeeded", "Failed")


_NOTHING: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ContainerRequest:
    name: str
    requests: Mapping[str, int]  # extended resources: requests == limits


@dataclass(frozen=True)
class PodInfo:
    """What the daemon keeps of one pod bound to this node."""

    namespace: str
    name: str
    uid: str
    node_name: str
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    created_at: float  # metadata.creationTimestamp, Unix seconds
    deleting: bool  # metadata.deletionTimestamp is set
    annotations: Mapping[str, str]
    containers: tuple[ContainerRequest, ...]  # spec.containers, in order
    init_containers: tuple[ContainerRequest, ...] = ()  # spec.initContainers, in order
    resource_version: str = ""
    # extenderchoice.decide's verdict, and why a placement on the pod was not believed.
    choice: ExtenderChoice | None = None
    choice_note: str = ""

    @cached_property
    def admission_time(self) -> float:
        """The extender's assume time, else creation (cached: not a field, so equality
        is unchanged)."""
        if self.choice is not None and self.choice.assumed_at_ns is not None:
            return self.choice.assumed_at_ns / 1e9
        return self.created_at

    @cached_property
    def indexed_containers(self) -> tuple[tuple[int, ContainerRequest], ...]:
        """(index, container) in kubelet's order: init containers -1, -2, ..., then 0, 1, ..."""
        specs = [(-1 - i, c) for i, c in enumerate(self.init_containers)]
        return (*specs, *enumerate(self.containers))


@dataclass(frozen=True)
class Demand:
    namespace: str
    pod: str
    container: str
    container_index: int  # position in spec.containers (init containers: -1 - position)
    memory_units: int
    core_percent: int
    extender_card_index: int | None
    pod_memory_units: int = 0  # the whole pod's memory request (ALIYUN_COM_GPU_MEM_POD)
    pod_uid: str = ""


def parse_extender_index(pod: PodInfo, container_index: int) -> int | None:
    """The GPU index the extender chose for this container, as the node believes it."""
    return pod.choice.card_for(container_index) if pod.choice is not None else None


def is_candidate_pod(pod: PodInfo, resources: tuple[str, ...]) -> bool:
    """Whether kubelet may still admit a container of this pod asking for one of ``resources``."""
    if pod.deleting or pod.phase != "Pending":
        return False
    return any(
        container.requests.get(resource, 0) > 0
        for container in (*pod.init_containers, *pod.containers)
        for resource in resources
    )


def asked_sizes(pod: PodInfo) -> frozenset[tuple[str, int]]:
    """Every (resource, size > 0) a container of ``pod`` requests: the pod cache's index."""
    return frozenset(
        (resource, size)
        for container in (*pod.init_containers, *pod.containers)
        for resource, size in container.requests.items()
        if size > 0
    )


# (namespace, pod, container, pod UID or "" where unknown) -> the shared resources held.
HeldByContainer = Mapping[tuple[str, str, str, str], frozenset[str]]


def held_by(held: HeldByContainer, pod: PodInfo, container: str) -> frozenset[str]:
    """What ``pod``'s ``container`` holds under the pod's UID or, where none was known
    at admission, its name; another UID's is another pod's."""
    own = held.get((pod.namespace, pod.name, container, pod.uid), _NOTHING)
    if not pod.uid:
        return own
    return own | held.get((pod.namespace, pod.name, container, ""), _NOTHING)


def find_demand(
    pods: Iterable[PodInfo],
    resource: str,
    size: int,
    memory_resource: str,
    core_resource: str,
    held: HeldByContainer,
) -> Demand | None:
    """The container kubelet is most likely admitting for ``size`` devices of ``resource``.

    A container holding some of its resources but not this one comes first: kubelet
    finishes one container before the next. None when no pod can be asking.
    """
    best_key: tuple[bool, float, str, str, int] | None = None
    best = None
    for pod in pods:
        if pod.deleting or pod.phase in FINISHED_PHASES:
            continue
        for position, (index, container) in enumerate(pod.indexed_containers):
            if container.requests.get(resource, 0) != size:
                continue
            holds = held_by(held, pod, container.name)
            if resource in holds:
                continue
            key = (not holds, pod.admission_time, pod.namespace, pod.name, position)
            if best_key is None or key < best_key:
                best_key, best = key, (pod, index, container)
    if best is None:
        return None
    pod, index, container = best
    return Demand(
        namespace=pod.namespace,
        pod=pod.name,
        container=container.name,
        container_index=index,
        memory_units=container.requests.get(memory_resource, 0),
        core_percent=container.requests.get(core_resource, 0),
        extender_card_index=parse_extender_index(pod, index),
        pod_memory_units=sum(c.requests.get(memory_resource, 0) for c in pod.containers),
        pod_uid=pod.uid,
    )
