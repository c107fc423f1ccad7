"""The allocation state of the node: devices, health, placement and the ledger.

The gRPC servicers only translate messages and call this object; tests call
it directly. Every decision happens under one lock and touches nothing slower
than the local SQLite ledger, so Allocate's latency does not depend on the
cluster (no API server, no kubelet call, no subprocess on that path).

Identifying the container being admitted (without the Kubernetes API): kubelet
admits pods one at a time and, for one container, allocates its resources one
after another (GetPreferredAllocation then Allocate, per resource). So a
shared Allocate that follows another container's first shared resource within
``ADMISSION_WINDOW_SECONDS``, for the resource that container does not hold
yet, is taken to be that container's second resource and is carried onto the
same card. The guess can be wrong for two single-resource pods admitted back
to back; kubelet's PodResources record corrects the ledger at the next
reconcile (reconcile.py splits such an allocation).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from mps.layout import CONTAINER_PIPE_DIRECTORY, MpsLayout
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.schema import Settings
from nodemgr.domain.deviceids import CORE_DEVICES_PER_CARD, ResourceKind, card_device_ids, card_of
from nodemgr.domain.deviceids import id_sort_key as _id_order
from nodemgr.domain.envs import shared_envs, whole_envs
from nodemgr.domain.model import Allocation, ContainerRef, Mount
from nodemgr.domain.placement import CardLoad, NoFitDescriber, SharedRequest, choose_card
from nodemgr.domain.podmatch import Demand, PodInfo, find_demand
from nodemgr.domain.reconcile import ReconcilePlan, plan_reconcile
from nodemgr.errors import ConflictError, LedgerError, NoFitError, UnknownDeviceError
from nodemgr.inventory import Card

log = logging.getLogger(__name__)

# kubelet allocates a container's resources back to back, in milliseconds;
# five seconds leaves room for a slow node without linking unrelated pods.
ADMISSION_WINDOW_SECONDS = 5.0
# kubelet and our pod watch see a newly bound pod at about the same time; when
# no cached pod matches yet, Allocate waits this long for the watch to catch up
# (only while the watch is live: with the API server down it does not wait).
POD_WAIT_SECONDS = 1.0


class PodSource(Protocol):
    """The pods bound to this node that kubelet may still admit (the Kubernetes adapter)."""

    @property
    def live(self) -> bool:
        """The cache is synced and its watch connected: worth waiting for."""
        ...

    @property
    def generation(self) -> int: ...

    def candidates(self) -> list[PodInfo]:
        """Pending pods asking for a shared resource; cheap, no I/O."""
        ...

    def wait_for_change(self, seen_generation: int, timeout: float) -> int: ...


@dataclass(frozen=True)
class DeviceInfo:
    id: str
    healthy: bool
    numa_node: int | None


@dataclass(frozen=True)
class AllocateResult:
    allocation_id: str
    envs: dict[str, str]
    mounts: tuple[Mount, ...] = ()


class _Usage:
    """Per-card totals of the allocations, kept up to date change by change.

    Admission reads these instead of walking every allocation, so its cost
    does not grow with the number of containers on the node.
    """

    def __init__(self) -> None:
        self.memory_units: Counter[str] = Counter()
        self.core_percent: Counter[str] = Counter()
        self.shared_allocations: Counter[str] = Counter()  # card -> shared allocations on it
        self.whole_allocations: Counter[str] = Counter()  # card -> whole allocations holding it
        self.holders: dict[tuple[ResourceKind, str], str] = {}  # device -> allocation ID

    def add(self, allocation: Allocation, sign: int = 1) -> None:
        for key in allocation.device_pairs():
            if sign > 0:
                self.holders[key] = allocation.id
            elif self.holders.get(key) == allocation.id:
                del self.holders[key]
        if allocation.whole:
            for card_uuid in allocation.cards:
                self.whole_allocations[card_uuid] += sign
        elif allocation.devices:
            card_uuid = allocation.cards[0]
            self.shared_allocations[card_uuid] += sign
            self.memory_units[card_uuid] += sign * allocation.memory_units
            self.core_percent[card_uuid] += sign * allocation.core_percent

    def shared_cards(self) -> set[str]:
        return {card for card, n in self.shared_allocations.items() if n > 0}

    def whole_cards(self) -> set[str]:
        return {card for card, n in self.whole_allocations.items() if n > 0}


def new_allocation_id() -> str:
    """Short, unguessable, unique: the runtime hook matches containers by it."""
    return "ga-" + secrets.token_hex(8)


class Allocator:
    def __init__(
        self,
        settings: Settings,
        cards: Sequence[Card],
        ledger: Ledger,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        mps_layout: MpsLayout | None = None,
        pods: PodSource | None = None,
    ):
        res = settings.resources
        self.node_name = settings.node_name
        self.resource_names = {ResourceKind.MEMORY: res.memory, ResourceKind.CORE: res.core}
        if res.whole:
            self.resource_names[ResourceKind.WHOLE] = res.whole
        self._kind_of_resource = {name: kind for kind, name in self.resource_names.items()}
        self._policy = res.placement
        self._unit_mib = res.memory_unit_mib
        self._grace_seconds = settings.kubelet.allocation_grace_seconds
        self.cards = tuple(cards)
        self._cards = {card.uuid: card for card in self.cards}
        self._units = {card.uuid: card.memory_mib // self._unit_mib for card in self.cards}
        self._describe = NoFitDescriber(settings.node_name, self._unit_mib)
        self._ledger = ledger
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation = 0
        # (allocation id, monotonic time) of the container whose second shared
        # resource may come next; see the module docstring.
        # The demand, when the pod was known, says exactly which resource and size the
        # container asks next, so no time window is needed then.
        self._open: tuple[str, float, Demand | None] | None = None
        # None: MPS off, shared containers get env quotas only.
        self._mps_layout = mps_layout
        # None: no Kubernetes API; a container's resources are linked by timing.
        self._pods = pods
        # Told of every refusal whose pod is known (the daemon posts a pod Event).
        self.on_refusal: Callable[[Demand, str], None] | None = None
        # card UUID -> why it takes no shared work now (its MPS daemon is down, ...).
        self._card_problems: dict[str, str] = {}
        # Set by PreStartContainer: kubelet's record now shows a new container.
        self.reconcile_requested = threading.Event()
        self._allocations = {a.id: a for a in ledger.load()}
        self._usage = _Usage()
        for allocation in self._allocations.values():
            self._usage.add(allocation)
        # kind -> (generation, device list): every ListAndWatch stream shares one build.
        self._device_lists: dict[ResourceKind, tuple[int, list[DeviceInfo]]] = {}
        self._check_memory_unit()

    def _check_memory_unit(self) -> None:
        """Memory device IDs count units: changing the unit under live allocations corrupts them."""
        stored = self._ledger.get_meta("memory_unit_mib")
        holding = [a for a in self._allocations.values() if a.memory_units]
        if stored is not None and int(stored) != self._unit_mib and holding:
            raise LedgerError(
                f"resources.memory_unit_mib is {self._unit_mib} but {len(holding)} live "
                f"allocations in {self._ledger.path} were made with {stored}: set it back to "
                f"{stored}, or drain the node's GPU pods before changing it"
            )
        self._ledger.set_meta("memory_unit_mib", str(self._unit_mib))

    # -- devices and health (ListAndWatch) ---------------------------------

    def devices(self, kind: ResourceKind) -> list[DeviceInfo]:
        """The full device list of one resource, with linkage health."""
        with self._lock:
            generation = self._generation
            cached = self._device_lists.get(kind)
            if cached is not None and cached[0] == generation:
                return cached[1]
            shared_cards, whole_cards = self._usage.shared_cards(), self._usage.whole_cards()
            problems = set(self._card_problems)
        listing = []
        for card in self.cards:
            if kind is ResourceKind.WHOLE:
                healthy = card.uuid not in shared_cards
            else:
                healthy = card.uuid not in whole_cards and card.uuid not in problems
            for device_id in card_device_ids(kind, card.uuid, self._units[card.uuid]):
                listing.append(DeviceInfo(device_id, healthy, card.numa_node))
        with self._lock:
            if self._generation == generation:
                self._device_lists[kind] = (generation, listing)
        return listing

    def wait_for_change(self, seen_generation: int, timeout: float) -> int:
        """Block until the state changes after ``seen_generation`` (or timeout); the new one."""
        with self._changed:
            self._changed.wait_for(lambda: self._generation != seen_generation, timeout)
            return self._generation

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def wake_watchers(self) -> None:
        """Let ListAndWatch streams re-check (e.g. because the server is stopping)."""
        with self._changed:
            self._changed.notify_all()

    # -- admission -------------------------------------------------------------

    def preferred(
        self, kind: ResourceKind, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        """The IDs kubelet should pick: all on the card placement chooses."""
        demand = self._demand(kind, size) if kind is not ResourceKind.WHOLE else None
        try:
            with self._lock:
                return self._preferred(kind, available, must_include, size, demand)
        except NoFitError as e:
            self._refused(demand, str(e))
            raise

    def _preferred(
        self,
        kind: ResourceKind,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        demand: Demand | None,
    ) -> list[str]:
        self._resolve(kind, must_include)
        free_ids = [i for i in available if card_of(kind, i) in self._cards]
        if kind is ResourceKind.WHOLE:
            rest = sorted(set(free_ids) - set(must_include), key=self._card_index)
            return list(must_include) + rest[: max(size - len(must_include), 0)]
        free_here = Counter(card_of(kind, i) for i in free_ids)
        carried = self._open_allocation(kind, size)
        if must_include:
            card_uuid = card_of(kind, must_include[0])
        elif carried is not None:
            card_uuid = carried.cards[0]
            if free_here[card_uuid] < size:
                self._open = None
                raise NoFitError(self._carry_refusal(kind, carried, size, free_here, demand))
        elif demand is not None:
            card_uuid = self._place(kind, demand, free_here)
        else:
            request = self._request(kind, size)
            card_uuid = choose_card(
                self._loads(kind, free_here), request, self._policy, self._describe
            ).uuid
        on_card = sorted(
            (i for i in free_ids if card_of(kind, i) == card_uuid and i not in must_include),
            key=_id_order,
        )
        return list(must_include) + on_card[: max(size - len(must_include), 0)]

    def _place(self, kind: ResourceKind, demand: Demand, free_here: Counter) -> str:
        """The card for a container's whole demand (memory and share together)."""
        request = SharedRequest(demand.memory_units, demand.core_percent)
        loads = self._loads(kind, free_here)
        who = f"{demand.namespace}/{demand.pod}/{demand.container}"
        if demand.extender_card_index is None:
            try:
                return choose_card(loads, request, self._policy, self._describe).uuid
            except NoFitError as e:
                raise NoFitError(f"{e} (for {who})") from None
        chosen = next((c for c in loads if c.index == demand.extender_card_index), None)
        if chosen is None:
            raise NoFitError(
                f"the scheduler extender chose GPU{demand.extender_card_index} for {who}, but "
                f"{self.node_name} has no such GPU (it has GPU0 to GPU{len(self.cards) - 1}): "
                "the extender's view of this node is stale"
            )
        if not request.fits(chosen):
            raise NoFitError(
                f"the scheduler extender chose GPU{chosen.index} for {who}, which needs "
                f"{self._describe.wanted(request)}, but {self._describe.card(chosen)}: the "
                "extender's view of this node is stale (check its cache and this node's "
                "allocations with nodemgr status)"
            )
        return chosen.uuid

    def allocate(self, kind: ResourceKind, device_ids: Sequence[str]) -> AllocateResult:
        """Record the container's devices durably, then give its env."""
        demand = self._demand(kind, len(device_ids)) if kind is not ResourceKind.WHOLE else None
        try:
            return self._allocate(kind, device_ids, demand)
        except (NoFitError, ConflictError) as e:
            self._refused(demand, str(e))
            raise

    def _allocate(
        self, kind: ResourceKind, device_ids: Sequence[str], demand: Demand | None
    ) -> AllocateResult:
        with self._lock:
            cards = self._resolve(kind, device_ids)
            if not device_ids:
                raise UnknownDeviceError(
                    f"{self.resource_names[kind]}: Allocate with no device IDs"
                )
            if len(set(device_ids)) != len(device_ids):
                raise UnknownDeviceError(
                    f"{self.resource_names[kind]}: the same device ID is requested twice"
                )
            if kind is ResourceKind.WHOLE:
                allocation = self._new_whole(device_ids, cards)
            else:
                allocation = self._new_or_carried_shared(kind, device_ids, cards, demand)
            self._store(allocation)
            mounts: tuple[Mount, ...] = ()
            if allocation.whole:
                envs = whole_envs(allocation, sorted(set(cards), key=self._card_index))
            else:
                card = self._cards[allocation.cards[0]]
                pipe = CONTAINER_PIPE_DIRECTORY if self._mps_layout else None
                envs = shared_envs(
                    allocation,
                    card.uuid,
                    card.index,
                    self._units[card.uuid],
                    pipe,
                    demand.pod_memory_units if demand else None,
                )
                mounts = self._mps_mounts(card.uuid)
            log.info(
                "allocated %s %s to allocation %s (%s)",
                self.resource_names[kind],
                _describe_ids(device_ids),
                allocation.id,
                ", ".join(f"{k}={v}" for k, v in sorted(envs.items())),
            )
            return AllocateResult(allocation.id, envs, mounts)

    def _mps_mounts(self, card_uuid: str) -> tuple[Mount, ...]:
        """The card's pipe directory and the shared MPS /dev/shm; the same for both resources."""
        if self._mps_layout is None:
            return ()
        return (
            Mount(CONTAINER_PIPE_DIRECTORY, self._mps_layout.pipe_dir(card_uuid)),
            Mount("/dev/shm", self._mps_layout.shm_dir),
        )

    # -- card state from the MPS supervisor -------------------------------------

    def whole_cards(self) -> set[str]:
        """UUIDs of the cards given out whole (they must leave MPS)."""
        with self._lock:
            return self._usage.whole_cards()

    def set_card_problem(self, card_uuid: str, problem: str | None) -> None:
        """Mark a card unable (problem) or able (None) to take shared work."""
        with self._lock:
            if self._card_problems.get(card_uuid) == problem:
                return
            if problem is None:
                del self._card_problems[card_uuid]
            else:
                self._card_problems[card_uuid] = problem
            self._generation += 1
            self._changed.notify_all()

    def set_grace_seconds(self, grace_seconds: float) -> None:
        """A config reload: kubelet.allocation_grace_seconds for the next reconcile."""
        with self._lock:
            self._grace_seconds = grace_seconds

    def responsive(self, timeout_seconds: float) -> bool:
        """Whether the allocation state can be read within the timeout (no thread holds it
        stuck): the run loop pings systemd's watchdog only when this holds."""
        if not self._lock.acquire(timeout=timeout_seconds):
            return False
        self._lock.release()
        return True

    def card_problems(self) -> dict[str, str]:
        with self._lock:
            return dict(self._card_problems)

    def check_known(self, kind: ResourceKind, device_ids: Sequence[str]) -> None:
        """PreStartContainer: the IDs must be ours; asks for a reconcile to learn the owner."""
        with self._lock:
            self._resolve(kind, device_ids)
        self.reconcile_requested.set()

    def _new_whole(self, device_ids: Sequence[str], cards: list[str]) -> Allocation:
        shared_cards = self._usage.shared_cards()
        busy = [self._card_label(c) for c in cards if c in shared_cards]
        if busy:
            raise ConflictError(
                f"{self.resource_names[ResourceKind.WHOLE]}: {', '.join(busy)} already hold "
                "shared allocations, so they cannot be given out whole"
            )
        return Allocation(
            id=new_allocation_id(),
            devices={ResourceKind.WHOLE: tuple(sorted(device_ids))},
            memory_mib=0,
            created_at=self._clock(),
        )

    def _new_or_carried_shared(
        self,
        kind: ResourceKind,
        device_ids: Sequence[str],
        cards: list[str],
        demand: Demand | None,
    ) -> Allocation:
        name = self.resource_names[kind]
        distinct = sorted(set(cards), key=self._card_index)
        if len(distinct) > 1:
            loads = self._loads(kind, Counter())
            raise NoFitError(
                self._describe(self._request(kind, len(device_ids)), loads)
                + f" (kubelet offered {name} IDs on "
                + ", ".join(f"GPU{self._card_index(c)}" for c in distinct)
                + "; one container's share must be on one card)"
            )
        card_uuid = distinct[0]
        if self._usage.whole_allocations[card_uuid] > 0:
            raise ConflictError(f"{name}: {self._card_label(card_uuid)} is given out whole")
        carried = self._open_allocation(kind, len(device_ids))
        self._open = None
        if carried is not None:
            if carried.cards[0] != card_uuid:
                other = next(iter(k for k in carried.devices))
                raise ConflictError(
                    f"{name} IDs are on {self._card_label(card_uuid)} but this container's "
                    f"{self.resource_names[other]} is on {self._card_label(carried.cards[0])}: "
                    "both must be on one card"
                )
            allocation = carried.with_devices(kind, list(device_ids))
        else:
            allocation = Allocation(
                id=new_allocation_id(),
                devices={kind: tuple(sorted(device_ids))},
                memory_mib=0,
                created_at=self._clock(),
                # Known from the pod cache; kubelet's record confirms (or corrects) it.
                owner=ContainerRef(demand.namespace, demand.pod, demand.container)
                if demand
                else None,
            )
            # Only a container's first shared resource can be carried over.
            self._open = (allocation.id, self._monotonic(), demand)
        return replace(allocation, memory_mib=allocation.memory_units * self._unit_mib)

    def _store(self, allocation: Allocation) -> None:
        """Write the allocation, taking its devices from stale holders (kubelet's choice wins).

        kubelet only hands out devices it considers free; if the ledger still
        has a holder, that pod is gone (or was an init container) and the next
        reconcile would have released it anyway.
        """
        taken: dict[str, set[tuple[ResourceKind, str]]] = defaultdict(set)
        for key in allocation.device_pairs():
            holder_id = self._usage.holders.get(key)
            if holder_id is not None and holder_id != allocation.id:
                taken[holder_id].add(key)
        puts, deletes = [allocation], []
        for holder_id, keys in taken.items():
            stale = self._allocations[holder_id]
            log.warning(
                "kubelet gave %d device(s) held by allocation %s (%s) to allocation %s: "
                "kubelet's record wins, the old holder was stale",
                len(keys),
                holder_id,
                stale.owner or "owner unknown",
                allocation.id,
            )
            devices = {
                kind: tuple(i for i in ids if (kind, i) not in keys)
                for kind, ids in stale.devices.items()
            }
            remaining = replace(stale, devices={k: ids for k, ids in devices.items() if ids})
            if remaining.devices:
                puts.append(replace(remaining, memory_mib=remaining.memory_units * self._unit_mib))
            else:
                deletes.append(holder_id)
        self._apply(puts, deletes)

    def _apply(self, puts: list[Allocation], deletes: list[str]) -> None:
        """Commit to the ledger first; only then change what is served."""
        self._ledger.commit(put=puts, delete=deletes)
        for allocation_id in deletes + [a.id for a in puts]:
            old = self._allocations.pop(allocation_id, None)
            if old is not None:
                self._usage.add(old, -1)
        for allocation in puts:
            self._allocations[allocation.id] = allocation
            self._usage.add(allocation)
        self._generation += 1
        self._changed.notify_all()

    # -- reconcile with kubelet ---------------------------------------------

    def reconcile(
        self, kubelet_record: Mapping[ContainerRef, Mapping[str, Sequence[str]]]
    ) -> ReconcilePlan:
        """Make the ledger say what kubelet's PodResources List says."""
        reported = {}
        for ref, resources in kubelet_record.items():
            for resource_name, device_ids in resources.items():
                kind = self._kind_of_resource.get(resource_name)
                if kind is None:
                    continue
                for device_id in device_ids:
                    if self._is_known(kind, device_id):
                        reported[(kind, device_id)] = ref
                    else:
                        log.warning(
                            "kubelet reports %s device %s for %s, which this node does not "
                            "advertise (GPU removed or memory unit changed?)",
                            resource_name,
                            device_id,
                            ref,
                        )
        with self._lock:
            plan = plan_reconcile(
                list(self._allocations.values()),
                reported,
                self._clock(),
                self._grace_seconds,
                self._unit_mib,
                new_allocation_id,
            )
            if not plan.empty:
                self._apply(plan.put, plan.delete)
        for note in plan.notes:
            log.info("reconcile: %s", note)
        return plan

    # -- views -------------------------------------------------------------------

    def card_label(self, card_uuid: str) -> str:
        """How operators see a card in messages: GPU<index> (<UUID>)."""
        return self._card_label(card_uuid) if card_uuid in self._cards else card_uuid

    def allocation(self, allocation_id: str) -> Allocation | None:
        with self._lock:
            return self._allocations.get(allocation_id)

    def allocations(self) -> list[Allocation]:
        with self._lock:
            return sorted(self._allocations.values(), key=lambda a: (a.created_at, a.id))

    # -- internals (callers hold the lock) -------------------------------------

    def _resolve(self, kind: ResourceKind, device_ids: Sequence[str]) -> list[str]:
        """The card of each ID; UnknownDeviceError naming the IDs this node never advertised."""
        unknown = [i for i in device_ids if not self._is_known(kind, i)]
        if unknown:
            example = card_device_ids(kind, self.cards[0].uuid, 1)[0] if self.cards else "none"
            raise UnknownDeviceError(
                f"{self.resource_names[kind]}: unknown device IDs {_describe_ids(unknown)} on "
                f"{self.node_name} (this node advertises IDs like {example}); were GPUs removed "
                "or resources.memory_unit_mib changed while pods held them?"
            )
        return [card_of(kind, i) for i in device_ids]

    def _is_known(self, kind: ResourceKind, device_id: str) -> bool:
        card_uuid = card_of(kind, device_id)
        if card_uuid not in self._cards:
            return False
        if kind is ResourceKind.WHOLE:
            return True
        index = int(device_id.rpartition("-_-")[2].lstrip("c"))
        limit = self._units[card_uuid] if kind is ResourceKind.MEMORY else CORE_DEVICES_PER_CARD
        return index < limit

    def _open_allocation(self, kind: ResourceKind, size: int) -> Allocation | None:
        """The allocation of the container being admitted, if this request is its next one.

        kubelet allocates one container's resources back to back, so the container
        whose first shared resource was just allocated is the one asking now when:
        its pod is known and it asks exactly this (no time limit needed), or, without
        the pod, the request comes within ADMISSION_WINDOW_SECONDS.
        """
        if self._open is None:
            return None
        allocation_id, since, demand = self._open
        allocation = self._allocations.get(allocation_id)
        if allocation is None or kind in allocation.devices:
            return None
        if demand is not None:
            wanted = demand.memory_units if kind is ResourceKind.MEMORY else demand.core_percent
            return allocation if wanted == size else None
        if self._monotonic() - since > ADMISSION_WINDOW_SECONDS:
            return None
        return allocation

    def _loads(self, kind: ResourceKind | None, kubelet_free: Counter) -> list[CardLoad]:
        """Per-card room; for ``kind``, kubelet's free IDs are the truth for that resource."""
        usage = self._usage
        loads = []
        for card in self.cards:
            memory_free = self._units[card.uuid] - usage.memory_units[card.uuid]
            core_free = CORE_DEVICES_PER_CARD - usage.core_percent[card.uuid]
            if kind is ResourceKind.MEMORY:
                memory_free = kubelet_free[card.uuid]
            elif kind is ResourceKind.CORE:
                core_free = kubelet_free[card.uuid]
            loads.append(
                CardLoad(
                    index=card.index,
                    uuid=card.uuid,
                    name=card.name,
                    memory_units_total=self._units[card.uuid],
                    memory_units_free=max(memory_free, 0),
                    core_percent_free=max(core_free, 0),
                    unavailable_reason="given out whole"
                    if usage.whole_allocations[card.uuid] > 0
                    else self._card_problems.get(card.uuid, ""),
                )
            )
        return loads

    def _request(self, kind: ResourceKind, size: int) -> SharedRequest:
        if kind is ResourceKind.MEMORY:
            return SharedRequest(memory_units=size)
        return SharedRequest(core_percent=size)

    def _carry_refusal(
        self,
        kind: ResourceKind,
        carried: Allocation,
        size: int,
        kubelet_free: Counter,
        demand: Demand | None = None,
    ) -> str:
        request = SharedRequest(
            memory_units=size if kind is ResourceKind.MEMORY else carried.memory_units,
            core_percent=size if kind is ResourceKind.CORE else carried.core_percent,
        )
        loads = self._loads(kind, kubelet_free)
        card = self._card_label(carried.cards[0])
        if demand is not None:
            return (
                f"{self._describe(request, loads)}; {demand.namespace}/{demand.pod}/"
                f"{demand.container} already holds its other GPU resource on {card}, which "
                f"has no room left for its {self.resource_names[kind]} request"
            )
        return (
            f"{self._describe(request, loads)}; this container's first GPU resource was "
            f"already placed on {card} before its {self.resource_names[kind]} request was "
            "known (without the Kubernetes API the daemon sees one resource at a time)"
        )

    def _card_index(self, card_uuid: str) -> int:
        return self._cards[card_uuid].index

    # -- the container being admitted, from the pod cache --------------------------

    def _demand(self, kind: ResourceKind, size: int) -> Demand | None:
        """Called without the lock: may wait up to POD_WAIT_SECONDS for the pod watch."""
        if self._pods is None:
            return None
        with self._lock:
            if self._open is not None and self._open_allocation(kind, size) is not None:
                return self._open[2]  # the container's second resource: its first one's demand
            held: dict[tuple[str, str, str], set[str]] = defaultdict(set)
            for allocation in self._allocations.values():
                if allocation.owner is not None and not allocation.whole:
                    owner = allocation.owner
                    for held_kind in allocation.devices:
                        held[(owner.namespace, owner.pod, owner.container)].add(
                            self.resource_names[held_kind]
                        )
        frozen = {key: frozenset(names) for key, names in held.items()}
        names = self.resource_names
        name, memory, core = names[kind], names[ResourceKind.MEMORY], names[ResourceKind.CORE]
        generation = self._pods.generation
        demand = find_demand(self._pods.candidates(), name, size, memory, core, frozen)
        deadline = self._monotonic() + POD_WAIT_SECONDS
        while demand is None and self._pods.live:
            left = deadline - self._monotonic()
            if left <= 0:
                log.info(
                    "%s: no pod bound to %s asks for %d; admitting without pod identity",
                    name,
                    self.node_name,
                    size,
                )
                break
            generation = self._pods.wait_for_change(generation, left)
            demand = find_demand(self._pods.candidates(), name, size, memory, core, frozen)
        return demand

    def _refused(self, demand: Demand | None, message: str) -> None:
        if demand is not None and self.on_refusal is not None:
            try:
                self.on_refusal(demand, message)
            except Exception:  # telling the pod must never change kubelet's answer
                log.exception("reporting a refusal failed")

    def _card_label(self, card_uuid: str) -> str:
        return f"GPU{self._card_index(card_uuid)} ({card_uuid})"


def _describe_ids(device_ids: Sequence[str]) -> str:
    shown = ", ".join(list(device_ids)[:4])
    more = len(device_ids) - 4
    return f"[{shown}{f', and {more} more' if more > 0 else ''}]"
