"""Admission: which container is asking, and the carry-over of its second shared resource.

kubelet admits pods one at a time and allocates a container's resources one after
another. After a container's first shared resource the container is *open*: its
request for the other one is carried onto the same card when its pod is known and it
asks exactly what the pod's spec says, or, without the pod cache, within
``ADMISSION_WINDOW_SECONDS`` (a guess that can link two single-resource pods admitted
back to back; kubelet's record corrects it at the next reconcile).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation
from nodemgr.domain.placement import CardLoad, NoFitDescriber, SharedRequest, choose_card
from nodemgr.domain.podmatch import Demand, HeldByContainer, PodInfo, find_demand
from nodemgr.errors import NoFitError

log = logging.getLogger(__name__)

# kubelet allocates a container's resources milliseconds apart; five seconds leaves
# room for a slow node without linking unrelated pods.
ADMISSION_WINDOW_SECONDS = 5.0
# kubelet and the pod watch see a newly bound pod at about the same time; Allocate
# waits this long for the watch to catch up, only while it is live.
POD_WAIT_SECONDS = 1.0

# (namespace, pod, container, pod UID or "") -> resource names it already holds
HeldResources = HeldByContainer


@dataclass(frozen=True)
class OpenAdmission:
    allocation_id: str
    since_monotonic: float
    demand: Demand | None  # None: the pod was not known


def carried_allocation(
    admission: OpenAdmission | None,
    allocations: Mapping[str, Allocation],
    kind: ResourceKind,
    size: int,
    now_monotonic: float,
) -> Allocation | None:
    """The open container's allocation, if a request for ``size`` of ``kind`` is its next one."""
    if admission is None:
        return None
    allocation = allocations.get(admission.allocation_id)
    if allocation is None or kind in allocation.devices:
        return None
    demand = admission.demand
    if demand is not None:
        wanted = demand.memory_units if kind is ResourceKind.MEMORY else demand.core_percent
        return allocation if wanted == size else None
    if now_monotonic - admission.since_monotonic > ADMISSION_WINDOW_SECONDS:
        return None
    return allocation


class PodSource(Protocol):
    """The pods bound to this node (the Kubernetes adapter)."""

    @property
    def live(self) -> bool:
        """The cache is synced and its watch connected: worth waiting for."""
        ...

    @property
    def generation(self) -> int: ...

    def candidates(self) -> list[PodInfo]:
        """Pending pods asking for a shared resource; cheap, no I/O."""
        ...

    def pod(self, namespace: str, name: str) -> PodInfo | None: ...

    def candidates_asking(self, resource: str, size: int) -> tuple[PodInfo, ...]:
        """Those requesting exactly ``size`` of ``resource``: an index lookup, no walk."""
        ...

    def wait_for_change(self, seen_generation: int, timeout: float) -> int: ...


class DemandFinder:
    """The container being admitted, from the pod cache (called without the allocator's lock)."""

    def __init__(
        self,
        pods: PodSource,
        resource_names: Mapping[ResourceKind, str],
        node_name: str,
        monotonic: Callable[[], float],
    ):
        self._pods = pods
        self._names = resource_names
        self._node_name = node_name
        self._monotonic = monotonic

    def find(self, kind: ResourceKind, size: int, held: HeldResources) -> Demand | None:
        """May wait up to POD_WAIT_SECONDS for the watch."""
        names = self._names
        name, memory, core = names[kind], names[ResourceKind.MEMORY], names[ResourceKind.CORE]
        generation = self._pods.generation
        # Walking hundreds of pending pods per admission would cost a quarter of the
        # daemon's CPU; only those asking exactly this can match.
        demand = find_demand(
            self._pods.candidates_asking(name, size), name, size, memory, core, held
        )
        deadline = self._monotonic() + POD_WAIT_SECONDS
        while demand is None and self._pods.live:
            left = deadline - self._monotonic()
            if left <= 0:
                log.info(
                    "%s: no pod bound to %s asks for %d; admitting without pod identity",
                    name,
                    self._node_name,
                    size,
                )
                break
            generation = self._pods.wait_for_change(generation, left)
            demand = find_demand(
                self._pods.candidates_asking(name, size), name, size, memory, core, held
            )
        return demand


def place_demand(
    demand: Demand,
    loads: Sequence[CardLoad],
    policy: str,
    describe: NoFitDescriber,
    node_name: str,
) -> str:
    """The card for a container's whole demand; the extender's choice is honoured, or
    refused clearly when its view has gone stale."""
    request = SharedRequest(demand.memory_units, demand.core_percent)
    who = f"{demand.namespace}/{demand.pod}/{demand.container}"
    if demand.extender_card_index is None:
        try:
            return choose_card(loads, request, policy, describe).uuid
        except NoFitError as e:
            raise NoFitError(f"{e} (for {who})") from None
    chosen = next((c for c in loads if c.index == demand.extender_card_index), None)
    if chosen is None:
        raise NoFitError(
            f"the scheduler extender chose GPU{demand.extender_card_index} for {who}, but "
            f"{node_name} has no such GPU (it has GPU0 to GPU{len(loads) - 1}): "
            "the extender's view of this node is stale"
        )
    if not request.fits(chosen):
        raise NoFitError(
            f"the scheduler extender chose GPU{chosen.index} for {who}, which needs "
            f"{describe.wanted(request)}, but {describe.card(chosen)}: the "
            "extender's view of this node is stale (check its cache and this node's "
            "allocations with nodemgr status)"
        )
    return chosen.uuid


def carry_refusal(
    describe: NoFitDescriber,
    loads: Sequence[CardLoad],
    resource_name: str,
    kind: ResourceKind,
    carried: Allocation,
    size: int,
    card_label: str,
    demand: Demand | None = None,
) -> str:
    request = SharedRequest(
        memory_units=size if kind is ResourceKind.MEMORY else carried.memory_units,
        core_percent=size if kind is ResourceKind.CORE else carried.core_percent,
    )
    if demand is not None:
        return (
            f"{describe(request, loads)}; {demand.namespace}/{demand.pod}/"
            f"{demand.container} already holds its other GPU resource on {card_label}, which "
            f"has no room left for its {resource_name} request"
        )
    return (
        f"{describe(request, loads)}; this container's first GPU resource was "
        f"already placed on {card_label} before its {resource_name} request was "
        "known (without the Kubernetes API the daemon sees one resource at a time)"
    )
