"""This node's ResourceSlice: one pool, one device per card, what the scheduler may place (pure).

kube-scheduler places DRA claims from the slices alone, so the slice says what a new
claim can get on each card (docs/dra.md, "The ResourceSlice"):

- one device per card, named by ``nodemgr.domain.claims.device_name``, with
  attributes ``uuid``, ``model``, ``index``, ``driverVersion`` (when known),
  ``mpsCapable`` (when known) and ``devicePluginInUse``;
- ``allowMultipleAllocations: true`` and two capacities:

  - ``memory``: what the device plugin does not hold, in bytes, a multiple of the
    memory unit; request policy ``validRange {min: unit, max: value, step: unit}``
    with default = value (a claim that does not name memory is charged all of it:
    without a quota it could use all of it), or ``validValues [unit]`` when exactly
    one unit is left;
  - ``cores``: the percent of the card's compute the device plugin does not hold;
    ``validRange {min: 0, max: value, step: 1}`` with default 0 (a claim that names
    no share gets none, as a device plugin container asking memory only), or
    ``validValues [0]`` when none is left;

  claims' own use is the scheduler's to add up (it knows its allocations), the device
  plugin's is shown by these lower values; a claim naming no capacity at all is
  charged all free memory and gets the card whole.
- a card is left out (not offered) while it takes no shared work (its MPS down or
  broken: its problem), while the device plugin gives it out whole, and when the
  device plugin holds all its memory: the API has no way to offer a device for new
  allocations only partly, taints need a feature gate this node cannot count on, and
  turning ``allowMultipleAllocations`` off would let the scheduler give the card whole
  over the shares it holds. Allocations already made keep working: kubelet prepares
  them from the claims, not from the slice.

The pool is the node's name; ``generation`` grows with every change (the publisher
keeps it); ``resourceSliceCount`` is 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nodemgr.domain.claims import CORE_CAPACITY, MEMORY_CAPACITY, MIB
from nodemgr.domain.model import Allocation
from nodemgr.domain.quantity import format_binary

MAX_STRING_ATTRIBUTE = 64


@dataclass(frozen=True)
class SliceCard:
    """A card as the slice shows it, with what the device plugin holds of it."""

    device: str  # the DRA device name
    uuid: str
    index: int
    model: str
    memory_units: int  # the card's memory in units
    mps_capable: bool | None  # compute capability >= 7.0 with MPS on; None: unknown
    plugin_memory_units: int = 0  # held by device plugin allocations
    plugin_core_percent: int = 0
    plugin_whole: bool = False  # given out whole by the device plugin
    problem: str | None = None  # why it takes no shared work now


@dataclass(frozen=True)
class PluginUse:
    memory_units: int = 0
    core_percent: int = 0
    whole: bool = False


def plugin_use(allocations: Iterable[Allocation]) -> dict[str, PluginUse]:
    """Card UUID -> what the device plugin's allocations (not claims') hold of it."""
    use: dict[str, PluginUse] = {}
    for allocation in allocations:
        if allocation.claim is not None:
            continue
        for card in allocation.cards:
            held = use.get(card, PluginUse())
            if allocation.whole:
                use[card] = PluginUse(held.memory_units, held.core_percent, True)
            else:
                use[card] = PluginUse(
                    held.memory_units + allocation.memory_units,
                    held.core_percent + allocation.core_percent,
                    held.whole,
                )
    return use


def device_of(card: SliceCard, unit_mib: int, driver_version: str | None) -> dict[str, Any] | None:
    """The card's device in the slice; None when it is not offered now."""
    free_units = card.memory_units - card.plugin_memory_units
    free_cores = 100 - card.plugin_core_percent
    if card.problem or card.plugin_whole or free_units < 1:
        return None
    attributes: dict[str, dict[str, Any]] = {
        "uuid": {"string": card.uuid[:MAX_STRING_ATTRIBUTE]},
        "model": {"string": card.model[:MAX_STRING_ATTRIBUTE]},
        "index": {"int": card.index},
        "devicePluginInUse": {"bool": bool(card.plugin_memory_units or card.plugin_core_percent)},
    }
    if driver_version:
        attributes["driverVersion"] = {"string": driver_version[:MAX_STRING_ATTRIBUTE]}
    if card.mps_capable is not None:
        attributes["mpsCapable"] = {"bool": card.mps_capable}
    return {
        "name": card.device,
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            MEMORY_CAPACITY: _memory(free_units, unit_mib),
            CORE_CAPACITY: _cores(max(free_cores, 0)),
        },
    }


def _memory(free_units: int, unit_mib: int) -> dict[str, Any]:
    unit = format_binary(unit_mib * MIB)
    value = format_binary(free_units * unit_mib * MIB)
    if free_units == 1:  # a range needs min + step <= value
        return {"value": value, "requestPolicy": {"default": unit, "validValues": [unit]}}
    policy = {"default": value, "validRange": {"min": unit, "max": value, "step": unit}}
    return {"value": value, "requestPolicy": policy}


def _cores(free: int) -> dict[str, Any]:
    if free == 0:
        return {"value": "0", "requestPolicy": {"default": "0", "validValues": ["0"]}}
    policy = {"default": "0", "validRange": {"min": "0", "max": str(free), "step": "1"}}
    return {"value": str(free), "requestPolicy": policy}


def slice_spec(
    node: str, driver: str, devices: list[dict[str, Any]], generation: int
) -> dict[str, Any]:
    """The ResourceSlice's spec: the node's pool, at ``generation``."""
    return {
        "driver": driver,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
        "nodeName": node,
        "devices": devices,
    }


def slice_cards(
    cards: Iterable[Any],
    unit_mib: int,
    use: Mapping[str, PluginUse],
    problems: Mapping[str, str],
    mps_enabled: bool,
    names: Mapping[str, str],
) -> list[SliceCard]:
    """The SliceCards of inventory cards (``names``: UUID -> device name)."""
    out = []
    for card in cards:
        held = use.get(card.uuid, PluginUse())
        out.append(
            SliceCard(
                device=names[card.uuid],
                uuid=card.uuid,
                index=card.index,
                model=card.name,
                memory_units=card.memory_mib // unit_mib,
                mps_capable=_mps_capable(card.compute_capability, mps_enabled),
                plugin_memory_units=held.memory_units,
                plugin_core_percent=held.core_percent,
                plugin_whole=held.whole,
                problem=problems.get(card.uuid),
            )
        )
    return out


def _mps_capable(capability: str | None, mps_enabled: bool) -> bool | None:
    """MPS limits need Volta (7.0) or newer and MPS on; None when the capability is
    unknown (simulated cards)."""
    if not mps_enabled:
        return False
    if not capability:
        return None
    major, _, minor = capability.partition(".")
    try:
        return (int(major), int(minor or 0)) >= (7, 0)
    except ValueError:
        return None
