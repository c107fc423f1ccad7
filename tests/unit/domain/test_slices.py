"""Pins nodemgr.domain.slices: the node's ResourceSlice passes the API server's validation
(standins/resource_v1.py, field by field as kube-apiserver), shows device plugin use
as lower capacities, leaves out cards that take no shares, and gives kube-scheduler's
arithmetic (standins/dra_allocator.py) the amounts the node expects."""

from __future__ import annotations

import pytest

from nodemgr.domain.claims import DeviceCard, claim_demand, device_cards
from nodemgr.domain.slices import SliceCard, device_of, plugin_use, slice_spec
from standins import dra_allocator, resource_v1
from standins.ledger_rows import allocation

DRIVER = "gpushare.aliyun.com"
GPU0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"


def card(**changes) -> SliceCard:
    values = dict(device=GPU0.lower(), uuid=GPU0, index=0, model="Tesla T4", memory_units=15,
                  mps_capable=True)  # fmt: skip
    values.update(changes)
    return SliceCard(**values)


def admitted(devices) -> dict:
    obj = {
        "metadata": {"name": "node-a-gpushare"},
        "spec": slice_spec("node-a", DRIVER, devices, 1),
    }
    errors = resource_v1.admit(resource_v1.SLICE, obj)
    assert errors == [], [str(e) for e in errors]
    return obj


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"plugin_memory_units": 6, "plugin_core_percent": 20},
        {"plugin_memory_units": 14},  # one unit left: validValues
        {"plugin_core_percent": 100},  # no share left: validValues [0]
        {"mps_capable": None},
    ],
)
def test_every_offered_device_passes_the_api_servers_validation(changes):
    """Capacities, request policies (range or values), attributes: admitted as written."""
    admitted([device_of(card(**changes), 1024, "550.54.15")])


def test_capacities_are_what_the_device_plugin_leaves():
    """6 GiB + 20 % held by device plugin pods: 9Gi and 80 offered, devicePluginInUse."""
    device = device_of(card(plugin_memory_units=6, plugin_core_percent=20), 1024, None)
    assert device["capacity"]["memory"]["value"] == "9Gi"
    assert device["capacity"]["cores"]["value"] == "80"
    assert device["attributes"]["devicePluginInUse"] == {"bool": True}
    assert "driverVersion" not in device["attributes"]


@pytest.mark.parametrize(
    "changes",
    [{"problem": "MPS control daemon down"}, {"plugin_whole": True}, {"plugin_memory_units": 15}],
)
def test_cards_that_take_no_shares_are_left_out(changes):
    """MPS down, given out whole by the device plugin, or no memory left: not offered."""
    assert device_of(card(**changes), 1024, None) is None


def scheduled(device, requests):
    obj = admitted([device])
    claim = {"metadata": {"uid": "u1", "namespace": "ns", "name": "c"}, "spec": {"devices": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": "c",
                                                 **({"capacity": {"requests": requests}}
                                                    if requests else {})}}]}}}  # fmt: skip
    claim["status"] = dra_allocator.allocate(claim, [obj], [], "node-a")
    devices = device_cards([DeviceCard(GPU0.lower(), GPU0, 0, 15360)])
    return claim_demand(claim, uid="u1", driver=DRIVER, pool="node-a", devices=devices,
                        unit_mib=1024)  # fmt: skip


def test_the_schedulers_arithmetic_on_the_slice_gives_what_the_node_expects():
    """As kube-scheduler computes consumedCapacity from the policies: 4Gi + 30 is 4 units
    and 30 %; 1500Mi rounds up to 2 units; memory alone gets no share (default 0);
    nothing named is the card whole."""
    device = device_of(card(), 1024, None)
    found = scheduled(device, {"memory": "4Gi", "cores": "30"})
    assert (found.memory_units, found.core_percent, found.whole) == (4, 30, False)
    assert scheduled(device, {"memory": "1500Mi"}).memory_units == 2
    assert scheduled(device, {"memory": "1Gi"}).core_percent == 0
    assert scheduled(device, None).whole


def test_plugin_use_counts_device_plugin_allocations_not_claims():
    """Claims are the scheduler's to count; device plugin allocations lower the slice."""
    from dataclasses import replace

    from nodemgr.domain.model import ClaimRef

    plugin = allocation("ga-1")  # 2 units + 3 % on its card (standins.ledger_rows)
    claim = replace(allocation("ga-2", units=0, percent=0), claim=ClaimRef("u", "n", "c", ()))
    use = plugin_use([plugin, claim])
    assert [(u.memory_units, u.core_percent, u.whole) for u in use.values()] == [
        (plugin.memory_units, plugin.core_percent, False)
    ]
