"""The allocation state of the node: devices, health, placement and the ledger.

Every decision happens under one lock and touches nothing slower than the local SQLite
ledger, so Allocate's latency does not depend on the cluster. The one exception is
``while_idle``: the MPS supervisor empties an idle card's /dev/shm tmpfs (its MPS control
daemon's and server's) under the lock, so no client of a new allocation meets the emptying.

The allocations are held once, in the ledger's committed image: every change is a
ledger commit under this lock (``_apply``), then the indexes follow (per-card totals,
:mod:`nodemgr.allocation.usage`; what the next reconcile must judge,
:mod:`nodemgr.allocation.backlog`). The device plugin servers see this object only
through :class:`~nodemgr.allocation.resources.ResourceManager`, the enforcement through
narrow Protocols of its own.

What it must not do: decide what needs no lock (placement, reconcile plans, envs
live in nodemgr.domain); wait on anything but the ledger while holding its lock.

Longer than 400 lines: every method reads or changes the state under the one lock.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from mps.layout import CONTAINER_PIPE_DIRECTORY, MpsLayout
from nodemgr.allocation.admission import (
    DemandFinder,
    OpenAdmission,
    PodSource,
    carried_allocation,
    carry_refusal,
    place_demand,
)
from nodemgr.allocation.backlog import Backlog, KubeletView, Work
from nodemgr.allocation.claims import place_claim, same_demand
from nodemgr.allocation.ledger import Ledger
from nodemgr.allocation.resources import AllocateResult, DeviceInfo
from nodemgr.allocation.usage import CardUsage, HeldByName, single_request, take_over_devices
from nodemgr.common.changes import ChangeCounter
from nodemgr.config.schema import Settings
from nodemgr.domain.claims import ClaimDemand
from nodemgr.domain.deviceids import (
    CORE_DEVICES_PER_CARD,
    ResourceKind,
    card_device_ids,
    card_of,
    cards_of,
    parse_device_id,
)
from nodemgr.domain.deviceids import id_sort_key as _id_order
from nodemgr.domain.envs import shared_envs, whole_envs
from nodemgr.domain.model import Allocation, ContainerRef, Mount
from nodemgr.domain.placement import CardLoad, NoFitDescriber, SharedRequest, choose_card
from nodemgr.domain.podmatch import FINISHED_PHASES, Demand
from nodemgr.domain.reconcile import DeviceKey, ReconcilePlan, plan_reconcile, plan_scoped
from nodemgr.errors import (
    AllocationError,
    ConflictError,
    GpushareError,
    LedgerError,
    NoFitError,
    UnknownDeviceError,
)
from nodemgr.inventory import Card

log = logging.getLogger(__name__)
T = TypeVar("T")


def shared_mounts(layout: MpsLayout | None, card_uuid: str) -> tuple[Mount, ...]:
    """The card's MPS client directory, read-only (a container must not replace
    ``control`` for the card's other tenants, docs/mps.md). No /dev/shm: an MPS client
    passes nothing to its server through it (measured on driver 580, docs/gpu-tests.md),
    so each container keeps its runtime's own, and no tenant reaches another's files
    (PyTorch passes tensors through them)."""
    if layout is None:
        return ()
    return (Mount(CONTAINER_PIPE_DIRECTORY, layout.client_dir(card_uuid), read_only=True),)


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
        on_refusal: Callable[[Demand, str], None] | None = None,
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
        self.changes = ChangeCounter()  # every change of allocations or card health
        # Only a card's health, whole use or shared use: the device lists depend on
        # nothing else, so ListAndWatch streams and the MPS supervisor sleep through
        # ordinary admissions.
        self.card_changes = ChangeCounter()
        self._open: OpenAdmission | None = None  # admission.py
        self._mps_layout = mps_layout  # None: MPS off
        self._pods = pods  # None: no Kubernetes API; resources are linked by timing
        self._demands = (
            DemandFinder(pods, self.resource_names, self.node_name, monotonic)
            if pods is not None
            else None
        )
        self._on_refusal = on_refusal  # posts a pod Event
        self._card_problems: dict[str, str] = {}  # why a card takes no shared work now
        self._id_hints: dict[ContainerRef, str] = {}  # keep_id_hints
        self.reconcile_requested = threading.Event()
        # Read-only here; every commit is made under this lock, so under it they hold still.
        self._allocations = ledger.allocations
        self._usage = CardUsage()
        for allocation in self._allocations.values():
            self._usage.add(allocation)
        self._backlog = Backlog()
        self._device_lists: dict[ResourceKind, _DeviceList] = {}  # shared by all streams
        self._view: KubeletView | None = None
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
        """The full device list of one resource, with linkage health: the same object while
        what it shows is unchanged (16 cards: ~17,000 memory IDs, not rebuilt at every
        ``card_changes``)."""
        with self._lock:
            generation = self.card_changes.generation
            cached = self._device_lists.get(kind)
            if cached is not None and cached.generation == generation:
                return cached.devices
            shows = self._list_shows(kind)
            if cached is not None and cached.shows == shows:
                self._device_lists[kind] = replace(cached, generation=generation)
                return cached.devices
        unhealthy, claimed = shows
        listing = []
        for card in self.cards:
            healthy = card.uuid not in unhealthy
            for device_id in card_device_ids(kind, card.uuid, self._units[card.uuid]):
                ok = healthy and device_id not in claimed
                listing.append(DeviceInfo(device_id, ok, card.numa_node))
        with self._lock:
            if self.card_changes.generation == generation:
                self._device_lists[kind] = _DeviceList(generation, shows, listing)
        return listing

    def _list_shows(self, kind: ResourceKind) -> tuple[frozenset[str], frozenset[str]]:
        """All one resource's device list depends on: the cards it shows unhealthy and the
        IDs claims hold (kubelet never hands out what a claim has; docs/dra.md, "Both
        doors")."""
        claimed = frozenset(i for k, i in self._usage.claim_held if k is kind)
        if kind is ResourceKind.WHOLE:
            shared = self._usage.shared_cards() | self._usage.claim_whole_cards()
            return frozenset(shared), claimed
        return frozenset(self._usage.whole_cards() | set(self._card_problems)), claimed

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
        if self._usage.claim_held:
            # kubelet may not have seen the list that marks a claim's IDs Unhealthy yet.
            held = self._usage.claim_held
            available = [i for i in available if (kind, i) not in held]
        cards = cards_of(kind, available)
        if kind is ResourceKind.WHOLE:
            return self._preferred_whole(available, cards, must_include, size)
        free_here = Counter(cards)
        for unknown in [c for c in free_here if c not in self._cards]:
            del free_here[unknown]
        try:
            return self._preferred_shared(
                kind, available, cards, free_here, must_include, size, demand
            )
        except NoFitError as e:
            # Offered although given out whole: kubelet's list is older than ours (which
            # lists them Unhealthy); placement left them out, the refusal says why.
            whole = [c for c in free_here if c and self._usage.whole_allocations[c] > 0]
            if not whole:
                raise
            raise NoFitError(f"{e}{self._stale_list_note(kind, whole)}") from None

    def _preferred_whole(
        self,
        available: Sequence[str],
        cards: list[str | None],
        must_include: Sequence[str],
        size: int,
    ) -> list[str]:
        """Whole cards kubelet offers, by index, without those holding shared work: kubelet's
        list can show one healthy for a moment after a share landed (the update in
        flight), and Allocate would refuse it, failing the pod for good."""
        busy = self._usage.shared_cards()
        free_ids = {
            i for i, c in zip(available, cards, strict=True) if c in self._cards and c not in busy
        }
        rest = sorted(free_ids - set(must_include), key=self._card_index)
        picked = list(must_include) + rest[: max(size - len(must_include), 0)]
        included = {c for c in cards_of(ResourceKind.WHOLE, must_include) if c in busy}
        if included or len(picked) < size:
            stale = included | {c for c in cards if c in busy}
            if stale:
                ordered = sorted((c for c in stale if c is not None), key=self._card_index)
                raise ConflictError(
                    self._shared_work_refusal(ordered, size) + " and no card free of shared "
                    "work is left"
                )
        return picked

    def _shared_work_refusal(self, cards: Sequence[str], size: int) -> str:
        claims: dict[str, set[str]] = {c: set() for c in cards}
        for kind, device_id in self._usage.claim_held:
            card_uuid = card_of(kind, device_id)
            if card_uuid in claims:
                claims[card_uuid].add(
                    str(self._allocations[self._usage.holders[(kind, device_id)]].claim)
                )
        held = []
        for card_uuid in cards:
            count = self._usage.shared_allocations[card_uuid]
            dra = f"; DRA: {', '.join(sorted(claims[card_uuid]))}" if claims[card_uuid] else ""
            held.append(f"{self._card_label(card_uuid)} holds shared allocations ({count}{dra})")
        return (
            f"{self.resource_names[ResourceKind.WHOLE]}: {size} whole card(s) asked, but "
            f"{'; '.join(held)}: a card holding shared work is not given out whole; kubelet's "
            "device list was stale (the update listing the card Unhealthy had not reached it)"
        )

    def _stale_list_note(self, kind: ResourceKind, whole: Sequence[str]) -> str:
        labels = ", ".join(self._card_label(c) for c in sorted(whole, key=self._card_index))
        return (
            f" (kubelet offered {self.resource_names[kind]} IDs of {labels}, given out whole: "
            "kubelet's device list was stale, the update listing them Unhealthy had not "
            "reached it)"
        )

    def _preferred_shared(
        self,
        kind: ResourceKind,
        available: Sequence[str],
        cards: list[str | None],
        free_here: Counter,
        must_include: Sequence[str],
        size: int,
        demand: Demand | None,
    ) -> list[str]:
        carried = self._open_allocation(kind, size)
        if must_include:
            card_uuid = card_of(kind, must_include[0])
        elif carried is not None:
            card_uuid = carried.cards[0]
            if free_here[card_uuid] < size:
                self._open = None
                message = carry_refusal(
                    self._describe,
                    self._loads(kind, free_here),
                    self.resource_names[kind],
                    kind,
                    carried,
                    size,
                    self._card_label(carried.cards[0]),
                    demand,
                )
                if demand is not None:
                    self._release_refused(carried, message)
                raise NoFitError(message)
        elif demand is not None:
            card_uuid = self._place(kind, demand, free_here, available)
        else:
            request = self._request(kind, size)
            card_uuid = choose_card(
                self._loads(kind, free_here), request, self._policy, self._describe
            ).uuid
        included = set(must_include)
        on_card = sorted(
            (
                i
                for i, c in zip(available, cards, strict=True)
                if c == card_uuid and i not in included
            ),
            key=_id_order,
        )
        return list(must_include) + on_card[: max(size - len(must_include), 0)]

    def _release_refused(self, carried: Allocation, why: str) -> None:
        """kubelet fails a pod one of whose resources is refused and never reports the
        others, so the first goes now; only with its pod known (else the link is a guess)."""
        if carried.confirmed_at is not None:
            return  # kubelet reported it: reconcile decides
        try:
            self._apply([], [carried.id])
        except LedgerError as e:  # kept; reconcile releases it after the grace
            log.warning("could not release allocation %s of a refused pod: %s", carried.id, e)
            return
        log.info("released allocation %s (%s): %s", carried.id, carried.owner, why)

    def _place(
        self, kind: ResourceKind, demand: Demand, free_here: Counter, available: Sequence[str]
    ) -> str:
        """The card for a container's whole demand (memory and share together).

        kubelet's free IDs are the truth for ``kind``; for the other resource the ledger
        counts, and it may still hold pods kubelet let go (the ledger follows at the next
        reconcile), so:

        - an allocation some of whose ``kind`` devices kubelet offers as free is gone
          (kubelet frees a pod's devices together): its other resource is free too;
        - if the demand then fits no card, neither counts an allocation whose pod the pod
          cache shows deleted, deleting or finished.

        A refusal here is final for the pod (kubelet never retries it)."""
        loads = self._loads(kind, free_here)
        gone = self._gone_by_kubelet(kind, available)
        if gone:
            loads = self._without(loads, kind, gone)
        try:
            return place_demand(demand, loads, self._policy, self._describe, self.node_name)
        except NoFitError as refused:
            leaving = self._gone_by_pod_cache() - gone
            if not leaving:
                raise
            try:
                card_uuid = place_demand(
                    demand,
                    self._without(loads, kind, leaving),
                    self._policy,
                    self._describe,
                    self.node_name,
                )
            except NoFitError:
                raise refused from None
            log.info(
                "%s/%s/%s: placed on %s not counting %d allocation(s) of pods deleted or "
                "finished (kubelet's list decides at the next request): %s",
                demand.namespace, demand.pod, demand.container,
                self._card_label(card_uuid), len(leaving), ", ".join(sorted(leaving)),
            )  # fmt: skip
            return card_uuid

    def _gone_by_kubelet(self, kind: ResourceKind, available: Sequence[str]) -> set[str]:
        """The allocations holding ``kind`` devices that kubelet offers as free."""
        holders = self._usage.holders
        return {holders[(kind, i)] for i in available if (kind, i) in holders}

    def _gone_by_pod_cache(self) -> set[str]:
        """Shared allocations whose pod the pod cache shows gone, finished or replaced by
        another UID (a walk: only when a refusal is at hand)."""
        if self._pods is None or not self._pods.live:
            return set()
        gone = set()
        for allocation in self._allocations.values():
            owner = allocation.owner
            if owner is None or allocation.whole or allocation.claim is not None:
                continue
            pod = self._pods.pod(owner.namespace, owner.pod)
            if (
                pod is None
                or pod.deleting
                or pod.phase in FINISHED_PHASES
                or not allocation.held_by(pod.namespace, pod.name, pod.uid)
            ):
                gone.add(allocation.id)
        return gone

    def _without(
        self, loads: Sequence[CardLoad], kind: ResourceKind, gone: set[str]
    ) -> list[CardLoad]:
        """``loads`` with the other resource (not ``kind``) of the allocations ``gone`` free."""
        memory: Counter[str] = Counter()
        core: Counter[str] = Counter()
        for allocation_id in gone:
            allocation = self._allocations.get(allocation_id)
            if allocation is None or allocation.whole or not allocation.devices:
                continue
            memory[allocation.cards[0]] += allocation.memory_units
            core[allocation.cards[0]] += allocation.core_percent
        result = []
        for load in loads:
            if kind is ResourceKind.CORE:
                memory_free = load.memory_units_free + memory[load.uuid]
                load = replace(load, memory_units_free=min(memory_free, load.memory_units_total))
            else:
                core_free = load.core_percent_free + core[load.uuid]
                load = replace(load, core_percent_free=min(core_free, CORE_DEVICES_PER_CARD))
            result.append(load)
        return result

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
            envs, mounts = self.container_edits(
                allocation, demand.pod_memory_units if demand else None
            )
            log.info(
                "allocated %s %s to allocation %s (%s)",
                self.resource_names[kind],
                _describe_ids(device_ids),
                allocation.id,
                ", ".join(f"{k}={v}" for k, v in sorted(envs.items())),
            )
            return AllocateResult(allocation.id, envs, mounts)

    def container_edits(
        self, allocation: Allocation, pod_memory_units: int | None = None
    ) -> tuple[dict[str, str], tuple[Mount, ...]]:
        """The one source of Allocate's env and mounts and a claim's CDI spec. Reads only
        what never changes: no lock."""
        if allocation.whole:
            return whole_envs(allocation, sorted(allocation.cards, key=self._card_index)), ()
        card = self._cards[allocation.cards[0]]
        pipe = CONTAINER_PIPE_DIRECTORY if self._mps_layout else None
        envs = shared_envs(
            allocation, card.uuid, card.index, self._units[card.uuid], pipe, pod_memory_units
        )
        return envs, shared_mounts(self._mps_layout, card.uuid)

    # -- DRA claims (nodemgr.allocation.claims.ClaimLedger) ------------------------

    def claim_allocation(self, claim_uid: str) -> Allocation | None:
        with self._lock:
            return self._claim_allocation(claim_uid)

    def claim_allocations(self) -> list[Allocation]:
        with self._lock:
            return [a for a in self._allocations.values() if a.claim is not None]

    def _claim_allocation(self, claim_uid: str) -> Allocation | None:
        for allocation in self._allocations.values():
            if allocation.claim is not None and allocation.claim.uid == claim_uid:
                return allocation
        return None

    def admit_claim(self, demand: ClaimDemand) -> tuple[Allocation, bool]:
        [admitted] = self.admit_claims([demand])
        if isinstance(admitted, GpushareError):
            raise admitted
        return admitted

    def admit_claims(
        self, demands: Sequence[ClaimDemand]
    ) -> list[tuple[Allocation, bool] | GpushareError]:
        """NodePrepareResources: each claim's allocation recorded before kubelet hears of
        it, against everything the ledger holds, in one transaction for the batch; the one
        already recorded when kubelet asks again. Per demand: (allocation, whether new), or
        the error that refused it."""
        answers: list[tuple[Allocation, bool] | GpushareError] = []
        with self._lock:
            staged: list[Allocation] = []
            updates: list[Allocation] = []  # recovered claims learning their request names
            for demand in demands:
                try:
                    answers.append(self._admit_one(demand, staged, updates))
                except AllocationError as e:
                    answers.append(e)
            for allocation in staged:  # _apply counts them in, after the commit
                self._usage.add(allocation, -1)
            if staged or updates:
                try:
                    self._apply(staged + updates, [])
                except LedgerError as e:
                    written = {a.id for a in staged + updates}
                    answers = [
                        e if isinstance(a, tuple) and a[0].id in written else a for a in answers
                    ]
                    staged = []
        for allocation in staged:
            assert allocation.claim is not None
            log.info(
                "prepared %s (UID %s) as allocation %s: %s MiB + %s %% on %s",
                allocation.claim,
                allocation.claim.uid,
                allocation.id,
                allocation.memory_mib,
                allocation.core_percent,
                ", ".join(self.card_label(c) for c in allocation.cards),
            )
        return answers

    def _admit_one(
        self, demand: ClaimDemand, staged: list[Allocation], updates: list[Allocation]
    ) -> tuple[Allocation, bool]:
        """Under the lock; a new allocation is counted at once (the next demand sees it)."""
        uid = demand.claim.uid
        existing = next(
            (a for a in staged + updates if a.claim is not None and a.claim.uid == uid), None
        ) or self._claim_allocation(uid)
        if existing is not None:
            if same_demand(existing, demand, self._unit_mib):
                if existing.claim != demand.claim and existing not in staged:
                    existing = replace(existing, claim=demand.claim)  # names learnt again
                    updates[:] = [u for u in updates if u.id != existing.id] + [existing]
                return existing, False
            raise ConflictError(
                f"{demand.claim} was prepared as {_holding(existing, self._unit_mib)} and "
                f"now asks {demand.describe(self._unit_mib)}: an allocated claim does not "
                "change; unprepare it first"
            )
        allocation = place_claim(
            demand,
            new_id=new_allocation_id,
            now=self._clock(),
            cards=self._cards,
            units=self._units,
            usage=self._usage,
            card_problems=self._card_problems,
            unit_mib=self._unit_mib,
        )
        self._usage.add(allocation)
        staged.append(allocation)
        return allocation, True

    def adopt_claim(self, demand: ClaimDemand, allocation_id: str) -> Allocation:
        """A claim prepared before the ledger was lost, taken back under the allocation ID
        its containers' env carries (nodemgr.dra.recovery)."""
        with self._lock:
            if self._claim_allocation(demand.claim.uid) is not None:
                raise ConflictError(f"{demand.claim} is already recorded")
            if allocation_id in self._allocations:
                raise ConflictError(f"allocation ID {allocation_id} is taken")
            allocation = place_claim(
                demand,
                new_id=lambda: allocation_id,
                now=self._clock(),
                cards=self._cards,
                units=self._units,
                usage=self._usage,
                card_problems={},  # already running: MPS health decides new shares only
                unit_mib=self._unit_mib,
            )
            self._apply([allocation], [])
        return allocation

    def release_claim(self, claim_uid: str) -> Allocation | None:
        with self._lock:
            allocation = self._claim_allocation(claim_uid)
            if allocation is None:
                return None
            self._apply([], [allocation.id])
        log.info("unprepared %s: released allocation %s", allocation.claim, allocation.id)
        return allocation

    # -- card state from the MPS supervisor -------------------------------------

    def whole_cards(self) -> set[str]:
        """They must leave MPS."""
        with self._lock:
            return self._usage.whole_cards()

    def shared_cards(self) -> set[str]:
        with self._lock:
            return self._usage.shared_cards()

    def while_idle(self, card_uuid: str, action: Callable[[], T]) -> T | None:
        """``action()`` while the card holds no shared allocation, admission waiting (a
        container admitted meanwhile would lose its first files); None when it holds one."""
        with self._lock:
            if card_uuid in self._usage.shared_cards():
                return None
            return action()

    def set_card_problem(self, card_uuid: str, problem: str | None) -> None:
        with self._lock:
            if self._card_problems.get(card_uuid) == problem:
                return
            if problem is None:
                del self._card_problems[card_uuid]
            else:
                self._card_problems[card_uuid] = problem
            self.card_changes.bump()
            self.changes.bump()

    def set_grace_seconds(self, grace_seconds: float) -> None:
        with self._lock:
            self._grace_seconds = grace_seconds

    def responsive(self, timeout_seconds: float) -> bool:
        """Whether the lock is had within the timeout: the run loop pings systemd's
        watchdog only then."""
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
        self.request_reconcile()

    def request_reconcile(self) -> None:
        """kubelet's record shows something new: the run loop reconciles at once."""
        self.reconcile_requested.set()

    def _new_whole(self, device_ids: Sequence[str], cards: list[str]) -> Allocation:
        shared_cards = self._usage.shared_cards()
        busy = sorted({c for c in cards if c in shared_cards}, key=self._card_index)
        if busy:
            raise ConflictError(self._shared_work_refusal(busy, len(device_ids)))
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
            raise ConflictError(
                f"{name}: {self._card_label(card_uuid)} is given out whole"
                + self._stale_list_note(kind, [card_uuid])
            )
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
                owner_uid=(demand.pod_uid or None) if demand else None,
            )
            # Only a container's first shared resource can be carried over.
            self._open = OpenAdmission(allocation.id, self._monotonic(), demand)
        return replace(allocation, memory_mib=allocation.memory_units * self._unit_mib)

    def _store(self, allocation: Allocation) -> None:
        """Taking its devices from stale holders (kubelet's choice wins)."""
        puts, deletes = take_over_devices(
            allocation, self._usage.holders, self._allocations, self._unit_mib
        )
        self._apply(puts, deletes)

    def _apply(self, puts: list[Allocation], deletes: list[str]) -> None:
        touched = dict.fromkeys([*deletes, *(a.id for a in puts)])
        before = {i: self._allocations.get(i) for i in touched}
        card_state = (self._usage.shared_cards(), self._usage.whole_cards())
        self._ledger.commit(put=puts, delete=deletes)
        after = {i: self._allocations.get(i) for i in touched}
        for old in before.values():
            if old is not None:
                self._usage.add(old, -1)
        for allocation_id, new in after.items():
            if new is not None:
                self._usage.add(new)
            self._backlog.changed(before[allocation_id], new)
        # The device lists show the IDs claims hold: a claim's change is a card change too.
        claims = any(
            a is not None and a.claim is not None for a in (*before.values(), *after.values())
        )
        if claims or (self._usage.shared_cards(), self._usage.whole_cards()) != card_state:
            self.card_changes.bump()
        self.changes.bump()

    @property
    def device_changes(self) -> ChangeCounter:
        return self.card_changes

    # -- reconcile with kubelet ---------------------------------------------

    def awaiting_adoption(self) -> set[str]:
        """The allocation IDs the next reconcile is to adopt with (``keep_id_hints``)."""
        with self._lock:
            return set(self._id_hints.values())

    def keep_id_hints(self, id_hints: Mapping[ContainerRef, str]) -> None:
        """Old allocation IDs for the next reconcile to adopt with (kubelet was not
        readable when a lost ledger was recovered)."""
        with self._lock:
            self._id_hints = dict(id_hints)

    def reconcile(
        self,
        kubelet_record: Mapping[ContainerRef, Mapping[str, Sequence[str]]],
        id_hints: Mapping[ContainerRef, str] | None = None,
    ) -> ReconcilePlan:
        """Make the ledger say what kubelet's PodResources List says, judging what changed
        since the last reconcile; all of it at start, with ``id_hints``, or after a plan
        could not be committed."""
        hints = id_hints if id_hints is not None else self._id_hints
        with self._lock:
            self._backlog.expire(self._clock(), self._grace_seconds, self._allocations)
            if not hints and self._backlog.idle(kubelet_record):
                return ReconcilePlan()  # the very record, nothing changed: not even read
        view = self._view_of(kubelet_record)
        with self._lock:
            work = self._backlog.work(view, self._allocations, self._usage.holders, bool(hints))
            if work.nothing:
                self._backlog.take(work)
                return ReconcilePlan()
            generation, now = self.changes.generation, self._clock()
        # Planned outside the lock so Allocate does not wait; applied only if nothing moved
        # meanwhile, else planned again under the lock.
        plan = self._plan(work, now, hints)
        with self._lock:
            if self.changes.generation != generation:
                work = self._backlog.work(view, self._allocations, self._usage.holders, bool(hints))
                plan = self._plan(work, self._clock(), hints)
            self._id_hints = {}  # adopted once; later adoptions are new pods
            judged_against = self._backlog.take(work)
            try:
                if not plan.empty:
                    self._apply(plan.put, plan.delete)
            except BaseException:
                self._backlog.give_back(work, judged_against)
                raise
            self._backlog.settled(work, self._allocations)
        for note in plan.notes:
            log.info("reconcile: %s", note)
        return plan

    def _plan(self, work: Work, now: float, hints: Mapping[ContainerRef, str]) -> ReconcilePlan:
        """``work``'s plan: the full walk or its scope alone. Claims' allocations are left
        out: kubelet's DRA manager releases them (unprepare), not the device plugin record."""
        reported, grace, unit = work.view.reported, self._grace_seconds, self._unit_mib
        if work.full:
            everything, reported = _without_claims(list(work.everything), reported)
            return plan_reconcile(everything, reported, now, grace, unit, new_allocation_id, hints)
        if work.scope is None:
            return ReconcilePlan()
        return plan_scoped(work.scope, reported, now, grace, unit, new_allocation_id)

    def _view_of(
        self, kubelet_record: Mapping[ContainerRef, Mapping[str, Sequence[str]]]
    ) -> KubeletView:
        """Each of this node's devices kubelet reports, with its container; the same record
        object as last time gives the same view without a walk."""
        view = self._view
        if view is None or view.record is not kubelet_record:
            view = KubeletView.read(kubelet_record, self._kind_of_resource, self._is_known)
            self._view = view
        return view

    # -- views -------------------------------------------------------------------

    def card_label(self, card_uuid: str) -> str:
        return self._card_label(card_uuid) if card_uuid in self._cards else card_uuid

    def allocation(self, allocation_id: str) -> Allocation | None:
        with self._lock:
            return self._allocations.get(allocation_id)

    def allocations(self) -> list[Allocation]:
        with self._lock:
            return sorted(self._allocations.values(), key=lambda a: (a.created_at, a.id))

    def allocations_by_id(self) -> dict[str, Allocation]:
        with self._lock:
            return dict(self._allocations)

    def allocation_count(self) -> int:
        with self._lock:
            return len(self._allocations)

    # -- internals (callers hold the lock) -------------------------------------

    def _resolve(self, kind: ResourceKind, device_ids: Sequence[str]) -> list[str]:
        unknown = [i for i in device_ids if not self._is_known(kind, i)]
        if unknown:
            example = card_device_ids(kind, self.cards[0].uuid, 1)[0] if self.cards else "none"
            raise UnknownDeviceError(
                f"{self.resource_names[kind]}: unknown device IDs {_describe_ids(unknown)} on "
                f"{self.node_name} (this node advertises IDs like {example}); were GPUs removed "
                "or resources.memory_unit_mib changed while pods held them?"
            )
        cards = [card_of(kind, i) for i in device_ids]
        return [card for card in cards if card is not None]  # all are: every ID is known

    def _is_known(self, kind: ResourceKind, device_id: str) -> bool:
        parsed = parse_device_id(kind, device_id)
        if parsed is None or parsed[0] not in self._cards:
            return False
        card_uuid, index = parsed
        if index is None:  # a whole card
            return True
        limit = self._units[card_uuid] if kind is ResourceKind.MEMORY else CORE_DEVICES_PER_CARD
        return index < limit

    def _open_allocation(self, kind: ResourceKind, size: int) -> Allocation | None:
        return carried_allocation(self._open, self._allocations, kind, size, self._monotonic())

    def _loads(self, kind: ResourceKind | None, kubelet_free: Counter) -> list[CardLoad]:
        """Per-card room; for ``kind``, kubelet's free IDs are the truth for that resource."""
        return self._usage.loads(self.cards, self._units, kind, kubelet_free, self._card_problems)

    def _request(self, kind: ResourceKind, size: int) -> SharedRequest:
        return single_request(kind, size)

    def _card_index(self, card_uuid: str) -> int:
        return self._cards[card_uuid].index

    # -- the container being admitted, from the pod cache --------------------------

    def _demand(self, kind: ResourceKind, size: int) -> Demand | None:
        """Called without the lock: may wait up to POD_WAIT_SECONDS for the pod watch."""
        if self._demands is None:
            return None
        with self._lock:
            if self._open is not None and self._open_allocation(kind, size) is not None:
                return self._open.demand  # the container's second resource: its first's demand
            held = HeldByName(dict(self._usage.held_kinds), self.resource_names)
        return self._demands.find(kind, size, held)

    def _refused(self, demand: Demand | None, message: str) -> None:
        if demand is not None and self._on_refusal is not None:
            try:
                self._on_refusal(demand, message)
            except Exception:  # telling the pod must never change kubelet's answer
                log.exception("reporting a refusal failed")

    def _card_label(self, card_uuid: str) -> str:
        return f"GPU{self._card_index(card_uuid)} ({card_uuid})"


@dataclass(frozen=True)
class _DeviceList:
    """One resource's device list as built, and what it shows (``Allocator._list_shows``)."""

    generation: int
    shows: tuple[frozenset[str], frozenset[str]]  # (unhealthy cards, IDs claims hold)
    devices: list[DeviceInfo]


def _holding(allocation: Allocation, unit_mib: int) -> str:
    if allocation.whole:
        return f"{len(allocation.cards)} whole card(s)"
    return f"{allocation.memory_units * unit_mib} MiB + {allocation.core_percent} %"


def _without_claims(
    allocations: list[Allocation], reported: Mapping[DeviceKey, ContainerRef]
) -> tuple[list[Allocation], dict[DeviceKey, ContainerRef]]:
    """The device plugin's part of the state and of kubelet's record (kubelet reporting a
    claim's device means it gave it to a container anyway: said at ERROR, never adopted)."""
    claimed: dict[DeviceKey, Allocation] = {}
    plugin = []
    for allocation in allocations:
        if allocation.claim is None:
            plugin.append(allocation)
        else:
            claimed.update((key, allocation) for key in allocation.device_pairs())
    kept = {}
    for key, ref in reported.items():
        holder = claimed.get(key)
        if holder is None:
            kept[key] = ref
        else:
            log.error(
                "kubelet reports device %s for %s, but %s (DRA) holds it: kubelet handed it "
                "out from a device list older than the claim; that container shares the "
                "claim's card share until one of them ends",
                key[1],
                ref,
                holder.claim,
            )
    return plugin, kept


def _describe_ids(device_ids: Sequence[str]) -> str:
    shown = ", ".join(list(device_ids)[:4])
    more = len(device_ids) - 4
    return f"[{shown}{f', and {more} more' if more > 0 else ''}]"
