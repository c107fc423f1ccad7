"""Per-card totals of the allocations, and each card's room as placement sees it.

Admission reads these instead of walking every allocation, so its cost does not grow
with the containers on the node. The allocator updates them under its lock.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

from nodemgr.domain.deviceids import CORE_DEVICES_PER_CARD, ResourceKind
from nodemgr.domain.model import Allocation
from nodemgr.domain.placement import CardLoad, SharedRequest
from nodemgr.errors import ConflictError
from nodemgr.inventory import Card

log = logging.getLogger(__name__)

# (namespace, pod, container, pod UID or "" where unknown)
HeldKey = tuple[str, str, str, str]


class CardUsage:
    def __init__(self) -> None:
        self.memory_units: Counter[str] = Counter()
        self.core_percent: Counter[str] = Counter()
        self.shared_allocations: Counter[str] = Counter()  # by card
        self.whole_allocations: Counter[str] = Counter()  # by card
        self.holders: dict[tuple[ResourceKind, str], str] = {}  # device -> allocation ID
        # Claims' devices, and per card how many claims hold it whole: listed Unhealthy.
        self.claim_held: set[tuple[ResourceKind, str]] = set()
        self.claim_whole: Counter[str] = Counter()
        # HeldKey -> the shared kinds its allocations hold, with counts.
        self.held_kinds: dict[HeldKey, frozenset[ResourceKind]] = {}
        self._held_counts: dict[HeldKey, Counter[ResourceKind]] = {}

    def add(self, allocation: Allocation, sign: int = 1) -> None:
        for key in allocation.device_pairs():
            if sign > 0:
                self.holders[key] = allocation.id
            elif self.holders.get(key) == allocation.id:
                del self.holders[key]
        if allocation.claim is not None:
            self._count_claim(allocation, sign)
        if allocation.owner is not None and not allocation.whole and allocation.devices:
            self._count_held(allocation, sign)
        if allocation.whole:
            for card_uuid in allocation.cards:
                self.whole_allocations[card_uuid] += sign
        elif allocation.devices:
            card_uuid = allocation.cards[0]
            self.shared_allocations[card_uuid] += sign
            self.memory_units[card_uuid] += sign * allocation.memory_units
            self.core_percent[card_uuid] += sign * allocation.core_percent

    def _count_claim(self, allocation: Allocation, sign: int) -> None:
        for key in allocation.device_pairs():
            if sign > 0:
                self.claim_held.add(key)
            else:
                self.claim_held.discard(key)
        if allocation.whole:
            for card_uuid in allocation.cards:
                self.claim_whole[card_uuid] += sign

    def claim_whole_cards(self) -> set[str]:
        return {card for card, n in self.claim_whole.items() if n > 0}

    def _count_held(self, allocation: Allocation, sign: int) -> None:
        owner = allocation.owner
        assert owner is not None
        key = (owner.namespace, owner.pod, owner.container, allocation.owner_uid or "")
        counts = self._held_counts.setdefault(key, Counter())
        for kind in allocation.devices:
            counts[kind] += sign
        kinds = frozenset(kind for kind, n in counts.items() if n > 0)
        if kinds:
            self.held_kinds[key] = kinds
        else:
            del self._held_counts[key]
            self.held_kinds.pop(key, None)

    def shared_cards(self) -> set[str]:
        return {card for card, n in self.shared_allocations.items() if n > 0}

    def whole_cards(self) -> set[str]:
        return {card for card, n in self.whole_allocations.items() if n > 0}

    def loads(
        self,
        cards: Sequence[Card],
        units: Mapping[str, int],
        kind: ResourceKind | None,
        kubelet_free: Counter,
        card_problems: Mapping[str, str],
    ) -> list[CardLoad]:
        """Per-card room; for ``kind``, kubelet's free IDs are the truth for that resource."""
        loads = []
        for card in cards:
            memory_free = units[card.uuid] - self.memory_units[card.uuid]
            core_free = CORE_DEVICES_PER_CARD - self.core_percent[card.uuid]
            if kind is ResourceKind.MEMORY:
                memory_free = kubelet_free[card.uuid]
            elif kind is ResourceKind.CORE:
                core_free = kubelet_free[card.uuid]
            loads.append(
                CardLoad(
                    index=card.index,
                    uuid=card.uuid,
                    name=card.name,
                    memory_units_total=units[card.uuid],
                    memory_units_free=max(memory_free, 0),
                    core_percent_free=max(core_free, 0),
                    unavailable_reason="given out whole"
                    if self.whole_allocations[card.uuid] > 0
                    else card_problems.get(card.uuid, ""),
                )
            )
        return loads


class HeldByName(Mapping[HeldKey, frozenset[str]]):
    """``CardUsage.held_kinds`` by resource name, translated per lookup (admission looks
    up a few containers, not all)."""

    def __init__(
        self,
        held_kinds: Mapping[HeldKey, frozenset[ResourceKind]],
        resource_names: Mapping[ResourceKind, str],
    ):
        self._kinds = held_kinds
        self._names = resource_names

    def __getitem__(self, key: HeldKey) -> frozenset[str]:
        return frozenset(self._names[kind] for kind in self._kinds[key])

    def get(self, key, default=None):
        # Mapping.get catches a KeyError; most containers asked about hold nothing.
        kinds = self._kinds.get(key)
        if kinds is None:
            return default
        return frozenset(self._names[kind] for kind in kinds)

    def __iter__(self) -> Iterator[HeldKey]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)


def single_request(kind: ResourceKind, size: int) -> SharedRequest:
    if kind is ResourceKind.MEMORY:
        return SharedRequest(memory_units=size)
    return SharedRequest(core_percent=size)


def take_over_devices(
    allocation: Allocation,
    holders: Mapping[tuple[ResourceKind, str], str],
    allocations: Mapping[str, Allocation],
    memory_unit_mib: int,
) -> tuple[list[Allocation], list[str]]:
    """(allocations to write, IDs to delete) to store ``allocation``. kubelet hands out
    only devices it considers free, so a stale holder's pod is gone (or was an init
    container) and the next reconcile would release it anyway."""
    taken: dict[str, set[tuple[ResourceKind, str]]] = defaultdict(set)
    for key in allocation.device_pairs():
        holder_id = holders.get(key)
        if holder_id is not None and holder_id != allocation.id:
            claim = allocations[holder_id].claim
            if claim is not None:
                # Listed Unhealthy: kubelet chose from an older list. Never taken over.
                raise ConflictError(
                    f"device {key[1]} is held by {claim} (DRA); kubelet chose it from a "
                    "device list older than the claim (a race): this admission fails, and "
                    "the pod's next one gets free devices"
                )
            taken[holder_id].add(key)
    puts, deletes = [allocation], []
    for holder_id, keys in taken.items():
        stale = allocations[holder_id]
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
            puts.append(replace(remaining, memory_mib=remaining.memory_units * memory_unit_mib))
        else:
            deletes.append(holder_id)
    return puts, deletes
