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

  the scheduler adds up claims' use itself; a claim naming no capacity is charged all
  free memory and gets the card whole.
- a card is left out while it takes no shared work (MPS down or broken), is given out
  whole by the device plugin, or has all its memory held by it: the API cannot offer a
  device only partly, taints need a feature gate, and ``allowMultipleAllocations`` off
  would let the scheduler give the card whole over its shares. Claims already
  prepared keep working: kubelet prepares from the claims, not the slice.

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
    device: str
    uuid: str
    index: int
    model: str
    memory_units: int
    mps_capable: bool | None  # compute capability >= 7.0 with MPS on; None: unknown
    plugin_memory_units: int = 0
    plugin_core_percent: int = 0
    plugin_whole: bool = False
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
    """MPS limits need Volta (7.0) or newer; None when the capability is unknown."""
    if not mps_enabled:
        return False
    if not capability:
        return None
    major, _, minor = capability.partition(".")
    try:
        return (int(major), int(minor or 0)) >= (7, 0)
    except ValueError:
        return None
