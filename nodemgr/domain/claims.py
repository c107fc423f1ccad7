"""What a DRA ResourceClaim asks of this node, read from the object the scheduler wrote (pure).

NodePrepareResources is admission: the driver must judge the allocation kube-scheduler
wrote into the claim's status before recording anything. ``claim_demand`` turns the
claim object into a ``ClaimDemand`` or refuses it with ``ClaimError`` saying why.

The rules (docs/dra.md, "What prepare checks"):

- the object must be the claim kubelet asked for (same UID), allocated, with at
  least one result of this driver, each from this node's pool and naming one of
  its devices (``device_name``: the card's UUID, lower-cased);
- a result the scheduler gave with a share ID and ``consumedCapacity`` whose request
  named a capacity is a share: memory a whole number of memory units (the slice's
  step), compute share 0-100 %; a claim holds at most one share (one container's
  share is on one card, as with the device plugin) and never a share and whole cards
  together;
- a result whose request named no capacity, or that the scheduler gave without a
  share ID (the device was not shared), is the card whole: outside MPS, fencing the
  card against shares;
- ``adminAccess`` results are refused (they would grant a card in use by others).

Capacity names are the ones this node publishes (``MEMORY_CAPACITY``,
``CORE_CAPACITY``), unqualified: the scheduler compares the claim's names with the
slice's as written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from nodemgr.domain import quantity
from nodemgr.domain.model import ClaimRef, ClaimResult
from nodemgr.errors import AllocationError

MEMORY_CAPACITY = "memory"
CORE_CAPACITY = "cores"
MIB = 1 << 20

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class ClaimError(AllocationError):
    """A claim this node refuses to prepare; the message is kubelet's per-claim error."""


@dataclass(frozen=True)
class DeviceCard:
    name: str
    uuid: str
    index: int
    memory_mib: int


@dataclass(frozen=True)
class ClaimDemand:
    """What a claim's results hold on this node: one share of one card, or whole cards."""

    claim: ClaimRef
    cards: tuple[str, ...]  # card UUIDs, in result order (one for a share)
    whole: bool
    memory_units: int = 0  # a share's memory, in units of resources.memory_unit_mib
    core_percent: int = 0  # a share's compute share, 0-100

    def describe(self, unit_mib: int) -> str:
        """``4096 MiB + 30 %`` or ``whole card``."""
        if self.whole:
            return "whole card" if len(self.cards) == 1 else f"{len(self.cards)} whole cards"
        return f"{self.memory_units * unit_mib} MiB + {self.core_percent} %"


def device_name(card_uuid: str) -> str:
    """The card's UUID, lower-cased: a DNS label, stable across reboots unlike the index.
    ValueError when it is none."""
    name = card_uuid.lower()
    if len(name) > 63 or not _DNS_LABEL.fullmatch(name):
        raise ValueError(
            f"card UUID {card_uuid!r} lower-cased is not a DNS label (at most 63 of a-z, "
            "0-9 and '-', alphanumeric at both ends): it cannot name a DRA device"
        )
    return name


def device_cards(cards: list[DeviceCard]) -> dict[str, DeviceCard]:
    """Device name -> card; ValueError when two cards would share a name."""
    named: dict[str, DeviceCard] = {}
    for card in cards:
        other = named.setdefault(card.name, card)
        if other is not card:
            raise ValueError(
                f"GPU{other.index} and GPU{card.index} both become DRA device {card.name!r}"
            )
    return named


def claim_demand(
    claim: Mapping[str, Any],
    *,
    uid: str,
    driver: str,
    pool: str,
    devices: Mapping[str, DeviceCard],
    unit_mib: int,
) -> ClaimDemand:
    meta = _dict(claim.get("metadata"))
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    what = f"claim {namespace}/{name}"
    if meta.get("uid") != uid:
        raise ClaimError(
            f"{what} has UID {meta.get('uid')!r}, kubelet asked for {uid!r}: the claim was "
            "deleted and made again; kubelet asks again for the new one"
        )
    allocation = _dict(_dict(claim.get("status")).get("allocation"))
    if not allocation:
        raise ClaimError(f"{what} is not allocated: nothing to prepare")
    results = [
        _dict(r)
        for r in _list(_dict(allocation.get("devices")).get("results"))
        if _dict(r).get("driver") == driver
    ]
    if not results:
        raise ClaimError(f"{what} has no allocation result of driver {driver}")
    requests = _requests(_dict(_dict(claim.get("spec")).get("devices")))
    parsed = [_result(what, r, pool, devices, requests, unit_mib) for r in results]
    ref = ClaimRef(uid, namespace, name, tuple(p[0] for p in parsed))
    cards = tuple(devices[r.device].uuid for r, _ in parsed)
    if len(set(cards)) != len(cards):
        raise ClaimError(
            f"{what} has several results on one card ({', '.join(r.device for r, _ in parsed)})"
            ": gpushare gives a claim one share of one card, or whole cards"
        )
    shares = [share for _, share in parsed if share is not None]
    if not shares:
        return ClaimDemand(ref, cards, whole=True)
    if len(parsed) > 1:
        raise ClaimError(
            f"{what} has {len(parsed)} results of driver {driver}, {len(shares)} of them "
            "shares: a claim may hold one share of one card (a container's memory and "
            "compute share are on one card), or whole cards only"
        )
    memory_units, core_percent = shares[0]
    return ClaimDemand(
        ref, cards, whole=False, memory_units=memory_units, core_percent=core_percent
    )


def _result(
    what: str,
    result: dict[str, Any],
    pool: str,
    devices: Mapping[str, DeviceCard],
    requests: dict[str, dict[str, Any]],
    unit_mib: int,
) -> tuple[ClaimResult, tuple[int, int] | None]:
    """(the result as recorded, (memory units, core percent) of a share or None: whole)."""
    request, device = str(result.get("request", "")), str(result.get("device", ""))
    share_id = result.get("shareID")
    if result.get("pool") != pool:
        raise ClaimError(
            f"{what}: result {request!r} is from pool {result.get('pool')!r}, this node "
            f"publishes pool {pool!r}"
        )
    card = devices.get(device)
    if card is None:
        raise ClaimError(
            f"{what}: result {request!r} names device {device!r}, which this node does "
            f"not have (its devices: {', '.join(sorted(devices)) or 'none'})"
        )
    if result.get("adminAccess"):
        raise ClaimError(
            f"{what}: result {request!r} asks for admin access to {device}, which gpushare "
            "does not give (it would reach a card other pods use)"
        )
    if share_id is not None and (not isinstance(share_id, str) or not share_id):
        raise ClaimError(f"{what}: result {request!r} has share ID {share_id!r}")
    recorded = ClaimResult(request, str(result.get("pool")), device, share_id)
    named = _capacity_requests(what, request, requests)
    consumed = result.get("consumedCapacity")
    if not named or share_id is None or consumed is None:
        return recorded, None  # the card whole
    label = f"{what}: result {request!r} on GPU{card.index} ({card.uuid})"
    return recorded, _share(label, _dict(consumed), card, unit_mib)


def _share(
    label: str, consumed: dict[str, Any], card: DeviceCard, unit_mib: int
) -> tuple[int, int]:
    unknown = sorted(set(consumed) - {MEMORY_CAPACITY, CORE_CAPACITY})
    if unknown:
        raise ClaimError(f"{label} consumes {', '.join(unknown)}, which this node never offered")
    amounts: dict[str, Fraction] = {}
    for key in (MEMORY_CAPACITY, CORE_CAPACITY):
        if key not in consumed:
            raise ClaimError(f"{label} has no consumed {key}: the scheduler writes every one")
        try:
            amounts[key] = quantity.parse(consumed[key])
        except quantity.QuantityError as e:
            raise ClaimError(f"{label}: consumed {key}: {e}") from e
    memory, cores = amounts[MEMORY_CAPACITY], amounts[CORE_CAPACITY]
    unit = unit_mib * MIB
    if memory <= 0 or memory % unit:
        raise ClaimError(
            f"{label} consumes {consumed[MEMORY_CAPACITY]} of memory: not a positive multiple "
            f"of the memory unit, {unit_mib} MiB (the slice's step)"
        )
    if memory > card.memory_mib * MIB:
        raise ClaimError(
            f"{label} consumes {consumed[MEMORY_CAPACITY]} of memory; the card has "
            f"{card.memory_mib} MiB"
        )
    if cores.denominator != 1 or not 0 <= cores <= 100:
        raise ClaimError(
            f"{label} consumes {consumed[CORE_CAPACITY]} cores: a share is 0 to 100 (percent)"
        )
    return int(memory // unit), int(cores)


def _requests(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Request name (``main``, or ``main/sub`` for a subrequest) -> its capacity requests."""
    named: dict[str, dict[str, Any]] = {}
    for request in _list(spec.get("requests")):
        request = _dict(request)
        base = str(request.get("name", ""))
        if request.get("exactly") is not None:
            named[base] = _dict(_dict(_dict(request["exactly"]).get("capacity")).get("requests"))
        for sub in _list(request.get("firstAvailable")):
            sub = _dict(sub)
            capacity = _dict(_dict(sub.get("capacity")).get("requests"))
            named[f"{base}/{sub.get('name', '')}"] = capacity
    return named


def _capacity_requests(
    what: str, request: str, requests: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    if request not in requests:
        raise ClaimError(f"{what}: result {request!r} names no request of the claim's spec")
    return requests[request]


def base_request(request: str) -> str:
    """What kubelet matches a container's ``resources.claims[].request`` with: the request
    (``main``), without the subrequest (``main/large``)."""
    return request.split("/", 1)[0]


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
