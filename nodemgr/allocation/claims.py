"""DRA claims in the allocation state: the narrow interface the DRA driver sees, and the
placement of a claim's demand on the devices the ledger has free.

A prepared claim is an ``Allocation`` like any other (``claim`` set), holding device IDs
of its card chosen here from those no allocation holds. So one ledger, one set of
totals and invariants cover both front doors: Allocate cannot be given a claim's IDs
(listed Unhealthy, a take-over refused), and a claim cannot be placed on a container's.
``place_claim`` runs under the allocator's lock and raises, naming the card and the
amounts, when the scheduler's allocation does not fit (an outdated slice, a race with
the device plugin).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from nodemgr.allocation.usage import CardUsage
from nodemgr.domain.claims import ClaimDemand
from nodemgr.domain.deviceids import (
    CORE_DEVICES_PER_CARD,
    ResourceKind,
    core_device_id,
    memory_device_id,
)
from nodemgr.domain.model import Allocation, ClaimResult, Mount
from nodemgr.errors import ConflictError, GpushareError, NoFitError
from nodemgr.inventory import Card


class ClaimLedger(Protocol):
    """What the DRA driver asks of the allocation state (Allocator implements it)."""

    def claim_allocation(self, claim_uid: str) -> Allocation | None: ...

    def claim_allocations(self) -> list[Allocation]: ...

    def admit_claims(
        self, demands: Sequence[ClaimDemand]
    ) -> list[tuple[Allocation, bool] | GpushareError]:
        """Allocator.admit_claims (prepare is idempotent)."""
        ...

    def release_claim(self, claim_uid: str) -> Allocation | None: ...

    def container_edits(
        self, allocation: Allocation, pod_memory_units: int | None = None
    ) -> tuple[dict[str, str], tuple[Mount, ...]]: ...

    def card_label(self, card_uuid: str) -> str:
        """GPU<index> (<UUID>)."""
        ...


def same_demand(allocation: Allocation, demand: ClaimDemand, unit_mib: int) -> bool:
    """Whether a recorded claim allocation is what ``demand`` asks (prepare again).
    Request names are not compared: a claim recovered after a lost ledger lacks them."""
    claim = allocation.claim
    if claim is None or allocation.whole != demand.whole or claim.uid != demand.claim.uid:
        return False
    if _devices(claim.results) != _devices(demand.claim.results):
        return False
    if demand.whole:
        return set(allocation.cards) == set(demand.cards)
    return (
        allocation.cards == demand.cards
        and allocation.memory_units == demand.memory_units
        and allocation.core_percent == demand.core_percent
        and allocation.memory_mib == demand.memory_units * unit_mib
    )


def _devices(results: Sequence[ClaimResult]) -> list[tuple[str, str, str]]:
    return sorted((r.pool, r.device, r.share_id or "") for r in results)


def place_claim(
    demand: ClaimDemand,
    *,
    new_id: Callable[[], str],
    now: float,
    cards: Mapping[str, Card],
    units: Mapping[str, int],
    usage: CardUsage,
    card_problems: Mapping[str, str],
    unit_mib: int,
) -> Allocation:
    what = str(demand.claim)
    for card_uuid in demand.cards:
        if card_uuid not in cards:
            raise ConflictError(f"{what}: card {card_uuid} is not on this node")
    if demand.whole:
        for card_uuid in demand.cards:
            card = cards[card_uuid]
            label = f"GPU{card.index} ({card.uuid})"
            if usage.whole_allocations[card_uuid] > 0:
                raise ConflictError(
                    f"{what} asks {label} whole, which is already given out whole; "
                    "the scheduler allocated from an outdated ResourceSlice"
                )
            if usage.shared_allocations[card_uuid] > 0:
                raise ConflictError(
                    f"{what} asks {label} whole, which holds "
                    f"{usage.shared_allocations[card_uuid]} shared allocation(s) (device plugin "
                    "pods or claims): a card is given whole only when nothing else is on it"
                )
        return Allocation(
            id=new_id(),
            devices={ResourceKind.WHOLE: tuple(sorted(demand.cards))},
            memory_mib=0,
            created_at=now,
            claim=demand.claim,
        )
    card_uuid = demand.cards[0]
    card = cards[card_uuid]
    label = f"GPU{card.index} ({card.uuid})"
    if usage.whole_allocations[card_uuid] > 0:
        raise ConflictError(f"{what} asks a share of {label}, which is given out whole")
    problem = card_problems.get(card_uuid)
    if problem:
        raise NoFitError(f"{what} asks a share of {label}, which takes no shared work: {problem}")
    if demand.memory_units == 0 and demand.core_percent == 0:
        raise NoFitError(f"{what} asks a share of {label} with no memory and no compute share")
    memory = _free(usage, ResourceKind.MEMORY, card_uuid, units[card_uuid], demand.memory_units)
    core = _free(usage, ResourceKind.CORE, card_uuid, CORE_DEVICES_PER_CARD, demand.core_percent)
    if memory is None or core is None:
        free_units = units[card_uuid] - usage.memory_units[card_uuid]
        free_core = CORE_DEVICES_PER_CARD - usage.core_percent[card_uuid]
        raise NoFitError(
            f"{what} asks {demand.describe(unit_mib)} of {label}, which has "
            f"{free_units * unit_mib} MiB + {free_core} % free (device plugin pods and "
            "claims together): the scheduler allocated from an outdated ResourceSlice, "
            "or a device plugin pod took the room meanwhile; nothing was recorded"
        )
    devices = {ResourceKind.MEMORY: memory, ResourceKind.CORE: core}
    return Allocation(
        id=new_id(),
        devices={kind: tuple(sorted(ids)) for kind, ids in devices.items() if ids},
        memory_mib=demand.memory_units * unit_mib,
        created_at=now,
        claim=demand.claim,
    )


def _free(
    usage: CardUsage, kind: ResourceKind, card_uuid: str, count: int, wanted: int
) -> tuple[str, ...] | None:
    if wanted == 0:
        return ()
    make = memory_device_id if kind is ResourceKind.MEMORY else core_device_id
    found = []
    for index in range(count):
        device_id = make(card_uuid, index)
        if (kind, device_id) not in usage.holders:
            found.append(device_id)
            if len(found) == wanted:
                return tuple(found)
    return None
