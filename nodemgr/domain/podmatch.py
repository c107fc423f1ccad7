"""Which container kubelet is admitting, from the pods bound to this node (pure, no I/O).

kubelet's GetPreferredAllocation and Allocate say how many devices of one
resource it wants, never for which pod. The Kubernetes adapter keeps a cache
of the pods bound to this node (one watch); this module picks, from that
cache and the allocations already made, the container being admitted:

- candidates are the containers of pods bound here, not being deleted, not
  finished, whose request of the resource equals the size asked and which do
  not hold that resource yet (what a pod holds is matched by its UID where the
  allocation knows it: a pod created again under its name holds nothing of the
  old one's, ``held_by``);
- kubelet admits pods one at a time and a pod's containers in order (init
  containers first), so the oldest pod (by the extender's assume time, else
  its creation time) and its first such container win.

The match gives the container's whole GPU demand (memory units, share) so the
first Allocate, whichever resource it is for, places both on one card; and
the card the scheduler extender chose, which must be honoured: the pod's
``choice`` (``nodemgr.domain.extenderchoice``: its signed placement, or, where
the node is told to trust them, the gpushare annotations
``ALIYUN_COM_GPU_MEM_IDX`` and per container
``scheduler.framework.gpushare.allocation``), never an annotation read here.
A wrong guess (two identical pending containers) puts the same
demand on another pod's name: kubelet's PodResources record corrects the
owner at the next reconcile, and the annotations follow the ledger.
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
    """One container of a pod spec and its integer extended-resource requests."""

    name: str
    requests: Mapping[
        str, int
    ]  # resource name -> quantity (extended resources: requests == limits)


@dataclass(frozen=True)
class PodInfo:
    """What the daemon keeps of one pod bound to this node (the adapter fills it in)."""

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
    # The scheduler extender's choice as the node believes it (extenderchoice.decide),
    # and why a placement written on the pod was not believed ("" when none was).
    choice: ExtenderChoice | None = None
    choice_note: str = ""

    @cached_property
    def admission_time(self) -> float:
        """When the pod was scheduled here: the extender's assume time, else creation.

        Computed once per PodInfo (an Allocate compares it for every pod asking the same
        size); kept in the instance's __dict__, not a field, so equality is unchanged.
        """
        if self.choice is not None and self.choice.assumed_at_ns is not None:
            return self.choice.assumed_at_ns / 1e9
        return self.created_at

    @cached_property
    def indexed_containers(self) -> tuple[tuple[int, ContainerRequest], ...]:
        """(index, container) in kubelet's order: init containers first, indexed -1, -2,
        ...; then the containers, indexed 0, 1, .... Built once per PodInfo, as
        admission_time."""
        specs = [(-1 - i, c) for i, c in enumerate(self.init_containers)]
        return (*specs, *enumerate(self.containers))


@dataclass(frozen=True)
class Demand:
    """The container being admitted and everything it asks of the shared resources."""

    namespace: str
    pod: str
    container: str
    container_index: int  # position in spec.containers (init containers: -1 - position)
    memory_units: int
    core_percent: int
    extender_card_index: int | None  # the card the scheduler extender chose, if any
    pod_memory_units: int = 0  # the whole pod's memory request (ALIYUN_COM_GPU_MEM_POD)
    pod_uid: str = ""


def parse_extender_index(pod: PodInfo, container_index: int) -> int | None:
    """The GPU index the extender chose for this container; None if it did not say (or
    the node does not believe what the pod says: ``pod.choice`` is None)."""
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
    """Every (resource, size) some container or init container of ``pod`` requests (> 0).

    The pod cache indexes candidates by these pairs: kubelet asks for one container's
    request of one resource, so only the pods asking that exact pair can match.
    """
    return frozenset(
        (resource, size)
        for container in (*pod.init_containers, *pod.containers)
        for resource, size in container.requests.items()
        if size > 0
    )


# (namespace, pod, container, pod UID or "" where unknown) -> the shared resources held.
HeldByContainer = Mapping[tuple[str, str, str, str], frozenset[str]]


def held_by(held: HeldByContainer, pod: PodInfo, container: str) -> frozenset[str]:
    """What ``pod``'s ``container`` holds: under the pod's UID, and under its name where
    the UID is unknown (admitted without the pod cache). What another UID holds under the
    same name is another pod's: one deleted, the name created again (a StatefulSet's)."""
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

    ``pods``: the candidate pods (see is_candidate_pod), or only those whose
    ``asked_sizes`` hold ``(resource, size)``: the others never match. ``held``: (namespace,
    pod, container, pod UID) -> the shared resources it already holds (from the ledger;
    see ``held_by``). A container that holds some of its resources but not this one
    comes first: kubelet finishes one container before the next. None when no
    pod can be asking.
    """
    best_key: tuple[bool, float, str, str, int] | None = None
    best = None
    for pod in pods:  # one pass, no list: an Allocate asks this of every pending pod
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
