"""Filter, prioritize and the card choice of bind, on the node's own card arithmetic (pure).

Everything goes through ``nodemgr.domain.placement``, the node daemon's own arithmetic,
so the extender and the node agree on what fits and which card the policy picks. On
one node, ``place`` puts:

- whole cards first: the pod needs max(sum over containers, max over init
  containers) of them, taken from the idle cards, lowest index first (as the
  daemon's preferred allocation gives them); those cards then take no shared
  container of this pod;
- init containers' memory and share together on one card (the daemon puts
  every init container on the pod-wide ``ALIYUN_COM_GPU_MEM_IDX`` card);
- each container's memory and share on one card, in order, by the policy,
  each container's choice reducing its card before the next.

``Unfit`` carries the reason a person reads in the pod's FailedScheduling event and
whether it is unresolvable (no card could hold the container even when empty, or no
gpushare-node: preemption cannot help).

What it must not do: any I/O, clock reading or locking (the caller passes
the time and holds the cache).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from nodemgr.domain.placement import (
    POLICIES,
    CardLoad,
    NoFitDescriber,
    SharedRequest,
    choose_card,
)
from nodemgr.domain.podmatch import (
    ALLOCATION_ANNOTATION,
    ASSIGNED_ANNOTATION,
    ASSUME_TIME_ANNOTATION,
    DEV_ANNOTATION,
    IDX_ANNOTATION,
    POD_ANNOTATION,
    PodInfo,
)
from nodemgr.errors import NoFitError
from nodemgr.extender.wire import MAX_PRIORITY, MIN_PRIORITY

RESERVED_FOR_WHOLE = "to be given out whole"


@dataclass(frozen=True)
class Resources:
    """As the node daemons are configured."""

    memory: str
    core: str
    whole: str
    memory_unit_mib: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.memory, self.core, self.whole) if n)


@dataclass(frozen=True, slots=True)
class ContainerDemand:
    index: int  # position in spec.containers; init containers: -1 - position
    name: str
    memory_units: int
    core_percent: int
    whole: int

    @property
    def shared(self) -> bool:
        return bool(self.memory_units or self.core_percent)

    @property
    def request(self) -> SharedRequest:
        return SharedRequest(self.memory_units, self.core_percent)


@dataclass(frozen=True, slots=True)
class PodDemand:
    """A pod's GPU containers, init containers first (kubelet's admission order)."""

    namespace: str
    name: str
    uid: str
    containers: tuple[ContainerDemand, ...]

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def whole_cards(self) -> int:
        app = sum(c.whole for c in self.containers if c.index >= 0)
        init = max((c.whole for c in self.containers if c.index < 0), default=0)
        return max(app, init)

    @property
    def wants_gpu(self) -> bool:
        return bool(self.containers)

    @property
    def shared_containers(self) -> tuple[ContainerDemand, ...]:
        return tuple(c for c in self.containers if c.shared)


def pod_demand(pod: PodInfo, resources: Resources) -> PodDemand:
    specs = [(-1 - i, c) for i, c in enumerate(pod.init_containers)]
    specs += list(enumerate(pod.containers))
    containers = []
    for index, container in specs:
        requests = container.requests
        demand = ContainerDemand(
            index,
            container.name,
            max(requests.get(resources.memory, 0), 0),
            max(requests.get(resources.core, 0), 0),
            max(requests.get(resources.whole, 0), 0) if resources.whole else 0,
        )
        if demand.shared or demand.whole:
            containers.append(demand)
    return PodDemand(pod.namespace, pod.name, pod.uid, tuple(containers))


@dataclass(frozen=True)
class NodeView:
    name: str
    loads: tuple[CardLoad, ...]  # every card; unavailable_reason set where no shared work goes
    idle: tuple[int, ...] = ()  # cards that can be given out whole, ascending
    problem: str = ""  # why the node takes no GPU pod at all

    def card(self, index: int) -> CardLoad | None:
        return next((c for c in self.loads if c.index == index), None)


@dataclass(frozen=True)
class Placement:
    node: str
    cards: Mapping[int, int]  # container index -> card index, for containers with a shared part
    whole_cards: tuple[int, ...]
    loads_after: tuple[CardLoad, ...]  # the node's cards with the pod placed

    @property
    def index(self) -> int | None:
        """ALIYUN_COM_GPU_MEM_IDX: the first shared container's in admission order."""
        return next(iter(self.cards.values()), None)


class Unfit(Exception):
    """The pod does not fit this node; the message says why, for a person."""

    def __init__(self, reason: str, unresolvable: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.unresolvable = unresolvable


def place(demand: PodDemand, view: NodeView, policy: str, memory_unit_mib: int) -> Placement:
    if view.problem:
        raise Unfit(view.problem, unresolvable=True)
    loads = list(view.loads)
    describe = NoFitDescriber(view.name, memory_unit_mib)
    whole = demand.whole_cards
    taken: tuple[int, ...] = ()
    if whole:
        if whole > len(view.idle):
            raise Unfit(_whole_refusal(whole, view), unresolvable=whole > len(loads))
        taken = view.idle[:whole]
        loads = [
            replace(c, unavailable_reason=RESERVED_FOR_WHOLE) if c.index in taken else c
            for c in loads
        ]
    cards: dict[int, int] = {}
    several = len(demand.shared_containers) > 1
    inits = [c for c in demand.containers if c.index < 0 and c.shared]
    if inits:
        request = SharedRequest(
            sum(c.memory_units for c in inits), sum(c.core_percent for c in inits)
        )
        label = "init containers " + ", ".join(c.name for c in inits)
        chosen = _choose(loads, request, policy, describe, label)
        _take(loads, chosen, request)
        cards.update((c.index, chosen.index) for c in inits)
    for container in demand.containers:
        if container.index < 0 or not container.shared:
            continue
        request = container.request
        chosen = _choose(
            loads, request, policy, describe, f"container {container.name}" if several else ""
        )
        _take(loads, chosen, request)
        cards[container.index] = chosen.index
    return Placement(view.name, cards, taken, tuple(loads))


def fits(demand: PodDemand, view: NodeView, policy: str, memory_unit_mib: int) -> None:
    """Filter's question; cheap for one container."""
    shared = demand.shared_containers
    if not view.problem and not demand.whole_cards and len(shared) == 1:
        request = shared[0].request
        for card in view.loads:
            if request.fits(card):
                return
    place(demand, view, policy, memory_unit_mib)


def _choose(
    loads: Sequence[CardLoad],
    request: SharedRequest,
    policy: str,
    describe: NoFitDescriber,
    label: str,
) -> CardLoad:
    try:
        return choose_card(loads, request, policy, describe)
    except NoFitError as e:
        reason = f"{label}: {e}" if label else str(e)
        hopeless = not any(
            c.memory_units_total >= request.memory_units and request.core_percent <= 100
            for c in loads
            if c.unavailable_reason in ("", "given out whole", RESERVED_FOR_WHOLE)
        )
        raise Unfit(reason, unresolvable=hopeless) from None


def _take(loads: list[CardLoad], card: CardLoad, request: SharedRequest) -> None:
    position = loads.index(card)
    loads[position] = replace(
        card,
        memory_units_free=card.memory_units_free - request.memory_units,
        core_percent_free=card.core_percent_free - request.core_percent,
    )


def _whole_refusal(whole: int, view: NodeView) -> str:
    states = ", ".join(
        f"GPU{c.index} {'free' if c.index in view.idle else _busy(c)}" for c in view.loads
    )
    cards = "GPU" if whole == 1 else "GPUs"
    return (
        f"{view.name} has {len(view.idle)} of {len(view.loads)} GPUs free to give out whole, "
        f"the pod needs {whole} whole {cards}: {states or 'no GPUs'}"
    )


def _busy(card: CardLoad) -> str:
    if card.unavailable_reason:
        return card.unavailable_reason
    return "holds shared work"


# --- filter and prioritize ------------------------------------------------------------


@dataclass
class FilterOutcome:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]


def filter_nodes(
    demand: PodDemand,
    names: Iterable[str],
    view_of: Callable[[str], NodeView],
    policy: str,
    memory_unit_mib: int,
) -> FilterOutcome:
    outcome = FilterOutcome([], {}, {})
    shared = demand.shared_containers
    # The common pod, one container with memory and/or share: any card that fits will do.
    request = shared[0].request if len(shared) == 1 and not demand.whole_cards else None
    for name in names:
        view = view_of(name)
        if request is not None and not view.problem:
            if any(request.fits(card) for card in view.loads):
                outcome.passed.append(name)
                continue
        try:
            place(demand, view, policy, memory_unit_mib)
        except Unfit as e:
            (outcome.unresolvable if e.unresolvable else outcome.failed)[name] = e.reason
        else:
            outcome.passed.append(name)
    return outcome


def score(placement: Placement, view: NodeView, policy: str) -> int:
    """0 to 10: the fill of the pod's cards averaged with the node's after the pod;
    binpack scores high fills high, spread low ones."""
    after = {c.index: c for c in placement.loads_after}
    chosen = [_fill(after[i]) for i in dict.fromkeys(placement.cards.values())]
    taken = set(placement.whole_cards)
    node = [1.0 if c.index in taken else _fill(c) for c in placement.loads_after]
    parts = [sum(p) / len(p) for p in (chosen, node) if p]
    if not parts:
        return MIN_PRIORITY
    average = min(max(sum(parts) / len(parts), 0.0), 1.0)
    value = average if policy == "binpack" else 1 - average
    return int(round(value * MAX_PRIORITY))


def _fill(card: CardLoad) -> float:
    if card.unavailable_reason and card.unavailable_reason != RESERVED_FOR_WHOLE:
        return 1.0  # given out whole, or unusable: nothing more goes there
    memory = (
        1 - card.memory_units_free / card.memory_units_total if card.memory_units_total else 1.0
    )
    return max(memory, 1 - card.core_percent_free / 100)


def prioritize(
    demand: PodDemand,
    names: Iterable[str],
    view_of: Callable[[str], NodeView],
    policy: str,
    memory_unit_mib: int,
) -> list[tuple[str, int]]:
    """A node the pod does not fit scores 0."""
    result = []
    for name in names:
        view = view_of(name)
        try:
            placement = place(demand, view, policy, memory_unit_mib)
        except Unfit:
            result.append((name, MIN_PRIORITY))
            continue
        result.append((name, score(placement, view, policy)))
    return result


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r} (one of {', '.join(POLICIES)})")
    return policy


# --- bind -------------------------------------------------------------------------------


def bind_annotations(
    demand: PodDemand, placement: Placement, view: NodeView, now_ns: int
) -> dict[str, str]:
    """The gpushare annotations (docs/gpushare-compat.md); {} for whole cards only. The
    share is not in the allocation map: ``kubectl inspect gpushare`` decodes it as
    memory; the node reads the share from the pod spec."""
    index = placement.index
    if index is None:
        return {}
    card = view.card(index)
    per_container = {
        str(c.index): {str(placement.cards[c.index]): c.memory_units}
        for c in demand.containers
        if c.index >= 0 and c.index in placement.cards
    }
    return {
        IDX_ANNOTATION: str(index),
        POD_ANNOTATION: str(sum(c.memory_units for c in demand.containers if c.index >= 0)),
        DEV_ANNOTATION: str(card.memory_units_total if card else 0),
        ASSIGNED_ANNOTATION: "false",
        ASSUME_TIME_ANNOTATION: str(now_ns),
        ALLOCATION_ANNOTATION: json.dumps(per_container, separators=(",", ":"), sort_keys=True),
    }
