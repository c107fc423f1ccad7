"""Pins nodemgr.kubelet.devicelists, the start-up check of the memory resource's device
list: a memory unit so small that kubelet could not read the list is refused, naming
the key and the smallest unit that fits; the size it goes by is exactly the size of the
message the servicer sends (healthy or not, any NUMA node, any number of digits)."""

import asyncio
import threading

import pytest

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.errors import ConfigError
from nodemgr.inventory import Card
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.devicelists import (
    MAX_LIST_BYTES,
    check_device_list_size,
    memory_device_list_bytes,
    smallest_safe_memory_unit_mib,
)
from nodemgr.kubelet.servicer import HEALTHY, UNHEALTHY, DevicePluginServicer
from standins.cards import simulated_settings

A100 = [Card(i, f"GPU-{i:08d}-0000-4000-8000-000000000000", "A100 80GB", 81920) for i in range(8)]


async def first_message(servicer: DevicePluginServicer) -> dp.ListAndWatchResponse:
    """The first message of a ListAndWatch stream, read as the plugin loop's server reads it."""
    stream = servicer.ListAndWatch(dp.Empty(), None)
    try:
        return await anext(stream)
    finally:
        await stream.aclose()


def sent_list(tmp_path, cards, memory_unit_mib: int, unhealthy: bool) -> dp.ListAndWatchResponse:
    """The first ListAndWatch message the real servicer sends for these cards."""
    settings = simulated_settings(str(tmp_path), memory_unit_mib=memory_unit_mib)
    ledger = Ledger(settings.state_dir)
    try:
        allocator = Allocator(settings, cards, ledger)
        if unhealthy:  # a card problem (MPS down) turns its memory devices Unhealthy
            for card in cards:
                allocator.set_card_problem(card.uuid, "MPS down (test)")
        servicer = DevicePluginServicer(allocator, ResourceKind.MEMORY, threading.Event())
        return asyncio.run(first_message(servicer))
    finally:
        ledger.close()


def test_mib_units_on_big_cards_are_refused_with_the_smallest_unit_that_fits():
    """1 MiB units on eight 80 GiB cards: refused on resources.memory_unit_mib, naming the
    device count and the smallest unit that fits; that unit is accepted, one less is not."""
    safe = smallest_safe_memory_unit_mib(A100)
    assert safe is not None and 1 < safe < 1024
    with pytest.raises(ConfigError) as refused:
        check_device_list_size(A100, 1)
    assert refused.value.key == "resources.memory_unit_mib"
    assert "655360 memory devices" in refused.value.problem
    assert f"use {safe} MiB or more" in refused.value.problem
    check_device_list_size(A100, safe)  # the unit the message names is accepted
    with pytest.raises(ConfigError):
        check_device_list_size(A100, safe - 1)


def test_gib_units_pass_on_the_same_cards():
    """Usual units on the same cards raise nothing."""
    check_device_list_size(A100, 1024)
    check_device_list_size(A100, 128)  # 5120 devices: well within kubelet's limit


def test_no_cards_pass():
    """A node without GPUs has an empty list: nothing to refuse."""
    check_device_list_size([], 1)
    assert memory_device_list_bytes([], 1) == 0


@pytest.mark.parametrize(
    ("memory_mib", "unit", "numa_node"),
    [
        (1, 1, None),  # one device: index 0
        (9, 1, 0),  # the last one-digit index; NUMA node 0 is empty on the wire
        (10, 1, 1),  # the first two-digit index
        (1000, 1, 3),  # 1..3 digits
        (15360, 1, 200),  # 5 digits; a NUMA ID of two varint bytes
        (15360, 7, None),  # a unit that does not divide the card
        (100, 1024, 0),  # a card smaller than the unit: no device at all
    ],
)
@pytest.mark.parametrize("unhealthy", [False, True])
def test_size_formula_equals_the_message_the_servicer_sends(
    tmp_path, memory_mib, unit, numa_node, unhealthy
):
    """The computed size is ByteSize() of the servicer's real first ListAndWatch message."""
    cards = [
        Card(0, "GPU-6a7c0000-0000-4000-8000-000000000000", "T4", memory_mib, numa_node),
        Card(1, "GPU-short", "T4", memory_mib // 2 or 1, None),
    ]
    message = sent_list(tmp_path, cards, unit, unhealthy)
    health = UNHEALTHY if unhealthy else HEALTHY
    assert {d.health for d in message.devices} <= {health}
    assert memory_device_list_bytes(cards, unit, health) == message.ByteSize()


def test_smallest_safe_unit_is_where_the_real_message_crosses_the_limit(tmp_path):
    """At the smallest safe unit the real (all Unhealthy) message fits; one MiB less does not."""
    safe = smallest_safe_memory_unit_mib(A100)
    fits = sent_list(tmp_path / "fits", A100, safe, unhealthy=True)
    too_big = sent_list(tmp_path / "too-big", A100, safe - 1, unhealthy=True)
    assert fits.ByteSize() <= MAX_LIST_BYTES < too_big.ByteSize()
