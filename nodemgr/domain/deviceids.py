"""Device IDs of the three resources, and the card each ID names (pure).

kubelet accounts devices by ID, so every ID names its card: the card of any
allocation can be recovered from kubelet's own record. IDs are stable across
restarts (built from the card UUID, never its index) and stay within
kubelet's 63-character limit (card UUIDs are at most 52 characters).

- memory: ``<UUID>-_-<j>``, one per memory unit, j from 0 (the gpushare
  convention, so existing tools read them);
- compute share: ``<UUID>-_-c<j>``, j from 0 to 99 (1 % of the card each);
- whole card: ``<UUID>``.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Sequence
from itertools import repeat

SEPARATOR = "-_-"
CORE_DEVICES_PER_CARD = 100
MAX_DEVICE_ID_LENGTH = 63

_MEMORY_SUFFIX = re.compile(r"(0|[1-9][0-9]*)")
_CORE_SUFFIX = re.compile(r"c(0|[1-9][0-9]?)")


class ResourceKind(enum.StrEnum):
    """The three things gpushare-node hands out; names in config say which resource is which."""

    MEMORY = "memory"
    CORE = "core"
    WHOLE = "whole"

    @property
    def shared(self) -> bool:
        return self is not ResourceKind.WHOLE


def memory_device_id(card_uuid: str, unit_index: int) -> str:
    return f"{card_uuid}{SEPARATOR}{unit_index}"


def core_device_id(card_uuid: str, percent_index: int) -> str:
    return f"{card_uuid}{SEPARATOR}c{percent_index}"


def card_device_ids(kind: ResourceKind, card_uuid: str, memory_units: int) -> list[str]:
    if kind is ResourceKind.MEMORY:
        return [memory_device_id(card_uuid, j) for j in range(memory_units)]
    if kind is ResourceKind.CORE:
        return [core_device_id(card_uuid, j) for j in range(CORE_DEVICES_PER_CARD)]
    return [card_uuid]


# Every Allocate and GetPreferredAllocation parses kubelet's whole free list (thousands
# of IDs). At most ~1,200 IDs per card and resource: this holds 16 such cards.
@functools.lru_cache(maxsize=1 << 16)
def parse_device_id(kind: ResourceKind, device_id: str) -> tuple[str, int | None] | None:
    """(card UUID, unit or percent index; None for a whole card), or None when the ID is
    not of ``kind``'s form. The only parser of IDs."""
    if kind is ResourceKind.WHOLE:
        return (device_id, None) if device_id and SEPARATOR not in device_id else None
    card_uuid, sep, suffix = device_id.rpartition(SEPARATOR)
    if not sep or not card_uuid:
        return None
    pattern = _MEMORY_SUFFIX if kind is ResourceKind.MEMORY else _CORE_SUFFIX
    if not pattern.fullmatch(suffix):
        return None
    return card_uuid, int(suffix.lstrip("c"))


def card_of(kind: ResourceKind, device_id: str) -> str | None:
    parsed = parse_device_id(kind, device_id)
    return None if parsed is None else parsed[0]


# Per kind; kubelet lists the same few thousand IDs again and again. Cleared when full.
_CARDS_SEEN: dict[ResourceKind, dict[str, str | None]] = {kind: {} for kind in ResourceKind}
_CARDS_SEEN_LIMIT = 1 << 16
_UNSEEN = object()


def cards_of(kind: ResourceKind, device_ids: Sequence[str]) -> list[str | None]:
    seen = _CARDS_SEEN[kind]
    cards = list(map(seen.get, device_ids, repeat(_UNSEEN)))
    if _UNSEEN in cards:
        if len(seen) > _CARDS_SEEN_LIMIT:
            seen.clear()
        for n, device_id in enumerate(device_ids):
            if cards[n] is _UNSEEN:
                cards[n] = seen[device_id] = card_of(kind, device_id)
    return cards  # type: ignore[return-value]  # no _UNSEEN is left


def id_sort_key(device_id: str) -> tuple[str, int]:
    """Order IDs by card, then numerically by unit (so 10 comes after 9)."""
    card_uuid, _, suffix = device_id.rpartition(SEPARATOR)
    digits = suffix.lstrip("c")
    return (card_uuid or device_id, int(digits) if digits.isdigit() else -1)
