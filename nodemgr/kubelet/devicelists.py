"""How big a resource's ListAndWatch message is, computed without building it.

kubelet reads ListAndWatch with gRPC's 4 MiB default message limit; a small
``resources.memory_unit_mib`` on big cards makes hundreds of thousands of devices, so
such a config is refused at start, naming the smallest unit that fits. A unit test
holds the arithmetic equal to ``ByteSize()`` of the message the servicer yields.
"""

from __future__ import annotations

from nodemgr.domain.deviceids import memory_device_id
from nodemgr.errors import ConfigError
from nodemgr.inventory import Card
from nodemgr.kubelet.servicer import UNHEALTHY

# Well under kubelet's 4 MiB.
MAX_LIST_BYTES = 1024 * 1024


def check_device_list_size(cards: tuple[Card, ...] | list[Card], memory_unit_mib: int) -> None:
    """Sized in the message's largest form: every device Unhealthy (a card's MPS down)."""
    size_bytes = memory_device_list_bytes(cards, memory_unit_mib)
    if size_bytes <= MAX_LIST_BYTES:
        return
    devices = sum(card.memory_mib // memory_unit_mib for card in cards)
    safe = smallest_safe_memory_unit_mib(cards)
    fix = (
        f"use {safe} MiB or more (the smallest unit whose device list fits for these cards)"
        if safe is not None
        else "these cards cannot be listed at any unit"
    )
    raise ConfigError(
        "resources.memory_unit_mib",
        f"{memory_unit_mib} MiB gives {devices} memory devices on this node, a ListAndWatch "
        f"message of up to {size_bytes / 2**20:.1f} MiB; kubelet refuses messages over 4 MiB "
        f"and gpushare-node keeps them under {MAX_LIST_BYTES // 1024} KiB: {fix}",
    )


def smallest_safe_memory_unit_mib(cards: tuple[Card, ...] | list[Card]) -> int | None:
    """A binary search (the size never grows with the unit); None if not even one device
    per card fits."""
    low, high = 1, max((card.memory_mib for card in cards), default=1)
    if memory_device_list_bytes(cards, high) > MAX_LIST_BYTES:
        return None
    while low < high:
        middle = (low + high) // 2
        if memory_device_list_bytes(cards, middle) <= MAX_LIST_BYTES:
            high = middle
        else:
            low = middle + 1
    return low


def memory_device_list_bytes(
    cards: tuple[Card, ...] | list[Card], memory_unit_mib: int, health: str = UNHEALTHY
) -> int:
    """Per device ``devices {ID, health, topology {nodes {ID}}}``, every tag one byte. A
    card's IDs differ only in the unit index, so the sum runs per digit count: a
    million devices are sized in microseconds."""
    health_bytes = _field_bytes(len(health.encode())) if health else 0  # "" is not sent
    total = 0
    for card in cards:
        units = card.memory_mib // memory_unit_mib
        prefix = len(memory_device_id(card.uuid, 0).encode()) - 1  # the ID less its index
        topology = 0
        if card.numa_node is not None:
            # NUMANode{ID: 0} is empty on the wire (proto3 default), but still sent.
            numa = 0 if card.numa_node == 0 else 1 + _varint_bytes(card.numa_node)
            topology = _field_bytes(_field_bytes(numa))
        low, digits = 0, 1
        while low < units:
            high = min(units, 10**digits)  # indexes low .. high-1 have `digits` digits
            device = _field_bytes(prefix + digits) + health_bytes + topology
            total += (high - low) * _field_bytes(device)
            low, digits = high, digits + 1
    return total


def _field_bytes(payload_bytes: int) -> int:
    """A length-delimited protobuf field with a one-byte tag."""
    return 1 + _varint_bytes(payload_bytes) + payload_bytes


def _varint_bytes(value: int) -> int:
    if value < 0:
        return 10  # negative int64: always ten bytes
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size
