"""The ledger's invariants: what must hold of the allocations at every moment (pure).

Checked by ``nodemgr check-ledger``, ``nodemgr doctor`` and the tests:

- no device ID is held by two live allocations;
- a shared allocation is on one card; its memory limit is its units x the unit;
- every card's allocated memory and share are within its capacity, and a card
  given out whole holds no shared allocation;
- every device ID names a card of this node, within that card's range;
- no container is registered to an allocation that is gone;
- a DRA claim's allocation holds exactly the cards its results name, and no two
  allocations are made for one claim;
- (with kubelet's record, after a reconcile) every device kubelet reports is
  held by an allocation of that container, and every allocation kubelet
  confirmed is still reported.

Each problem is one sentence naming the allocation, card or container.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from nodemgr.domain.deviceids import CORE_DEVICES_PER_CARD, ResourceKind, parse_device_id
from nodemgr.domain.model import Allocation, ContainerRef, Registration


@dataclass(frozen=True)
class CardCapacity:
    uuid: str
    index: int
    memory_units: int  # memory_mib // memory_unit_mib


def check_invariants(
    allocations: Sequence[Allocation],
    cards: Sequence[CardCapacity] | None,
    memory_unit_mib: int,
    registrations: Iterable[Registration] = (),
    kubelet_record: Mapping[ContainerRef, Mapping[ResourceKind, Sequence[str]]] | None = None,
) -> list[str]:
    """Every broken invariant, one sentence each; ``cards`` None skips the capacity checks."""
    problems: list[str] = []
    holders: dict[tuple[ResourceKind, str], str] = {}
    for allocation in allocations:
        for key in allocation.device_pairs():
            other = holders.setdefault(key, allocation.id)
            if other != allocation.id:
                problems.append(
                    f"device {key[1]} ({key[0]}) is held by both {other} and {allocation.id}"
                )
        if not allocation.whole:
            if len(allocation.cards) > 1:
                problems.append(
                    f"shared allocation {allocation.id} spans {len(allocation.cards)} cards "
                    f"({', '.join(allocation.cards)}): a container's share must be on one card"
                )
            expected_mib = allocation.memory_units * memory_unit_mib
            if allocation.memory_mib != expected_mib:
                problems.append(
                    f"allocation {allocation.id} says {allocation.memory_mib} MiB but holds "
                    f"{allocation.memory_units} units of {memory_unit_mib} MiB ({expected_mib} MiB)"
                )
    if cards is not None:
        problems += _capacity_problems(allocations, cards)
    problems += _claim_problems(allocations)
    live = {a.id for a in allocations}
    for registration in registrations:
        if registration.allocation_id not in live:
            problems.append(
                f"container {registration.container_id} is registered to allocation "
                f"{registration.allocation_id}, which no longer exists"
            )
    if kubelet_record is not None:
        problems += _kubelet_problems(allocations, holders, kubelet_record)
    return problems


def _claim_problems(allocations: Sequence[Allocation]) -> list[str]:
    problems = []
    seen: dict[str, str] = {}
    for allocation in allocations:
        claim = allocation.claim
        if claim is None:
            continue
        other = seen.setdefault(claim.uid, allocation.id)
        if other != allocation.id:
            problems.append(
                f"{claim} (UID {claim.uid}) has two allocations, {other} and {allocation.id}"
            )
        named = sorted(r.device for r in claim.results)
        held = sorted(card.lower() for card in allocation.cards)
        if named != held:
            problems.append(
                f"allocation {allocation.id} of {claim} holds cards {', '.join(allocation.cards)} "
                f"but its results name devices {', '.join(named)}"
            )
    return problems


def _capacity_problems(
    allocations: Sequence[Allocation], cards: Sequence[CardCapacity]
) -> list[str]:
    problems = []
    by_uuid = {card.uuid: card for card in cards}
    memory: Counter[str] = Counter()
    core: Counter[str] = Counter()
    whole: set[str] = set()
    shared: set[str] = set()
    for allocation in allocations:
        for kind, device_id in allocation.device_pairs():
            parsed = parse_device_id(kind, device_id)
            card = by_uuid.get(parsed[0]) if parsed else None
            if parsed is None or card is None:
                problems.append(
                    f"allocation {allocation.id} holds {device_id} ({kind}), which names no "
                    "card of this node"
                )
                continue
            index = parsed[1]
            limit = card.memory_units if kind is ResourceKind.MEMORY else CORE_DEVICES_PER_CARD
            if index is not None and index >= limit:
                problems.append(
                    f"allocation {allocation.id} holds {device_id}, beyond GPU{card.index}'s "
                    f"{limit} {kind} devices"
                )
            if kind is ResourceKind.WHOLE:
                whole.add(card.uuid)
            else:
                shared.add(card.uuid)
                (memory if kind is ResourceKind.MEMORY else core)[card.uuid] += 1
    for card in cards:
        if memory[card.uuid] > card.memory_units:
            problems.append(
                f"GPU{card.index} has {memory[card.uuid]} memory units allocated of "
                f"{card.memory_units}"
            )
        if core[card.uuid] > CORE_DEVICES_PER_CARD:
            problems.append(f"GPU{card.index} has {core[card.uuid]} % of its share allocated")
        if card.uuid in whole and card.uuid in shared:
            problems.append(f"GPU{card.index} is given out whole and also holds shared work")
    return problems


def _kubelet_problems(
    allocations: Sequence[Allocation],
    holders: Mapping[tuple[ResourceKind, str], str],
    record: Mapping[ContainerRef, Mapping[ResourceKind, Sequence[str]]],
) -> list[str]:
    problems = []
    by_id = {a.id: a for a in allocations}
    reported: dict[str, set[ContainerRef]] = defaultdict(set)
    for ref, resources in record.items():
        for kind, device_ids in resources.items():
            for device_id in device_ids:
                holder = holders.get((kind, device_id))
                if holder is None:
                    problems.append(
                        f"kubelet says {ref} holds {device_id} ({kind}), but no allocation does"
                    )
                    continue
                reported[holder].add(ref)
                owner = by_id[holder].owner
                if owner is not None and owner != ref:
                    problems.append(
                        f"kubelet says {ref} holds {device_id}, but allocation {holder} "
                        f"belongs to {owner}"
                    )
    for allocation in allocations:
        if allocation.confirmed_at is not None and allocation.id not in reported:
            problems.append(
                f"allocation {allocation.id} ({allocation.owner}) was confirmed by kubelet "
                "but kubelet no longer reports it"
            )
    return problems
