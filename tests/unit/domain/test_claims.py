"""Pins nodemgr.domain.claims: what a ResourceClaim, as kube-scheduler allocated it, asks
of this node (one share of one card, or whole cards), and every refusal naming why."""

from __future__ import annotations

import copy

import pytest

from nodemgr.domain.claims import (
    ClaimError,
    DeviceCard,
    base_request,
    claim_demand,
    device_cards,
    device_name,
)
from nodemgr.domain.model import ClaimResult

DRIVER = "gpushare.aliyun.com"
GPU0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU1 = "GPU-bbbbbbbb-1111-1111-1111-111111111111"
DEVICES = device_cards(
    [
        DeviceCard(device_name(GPU0), GPU0, 0, 15360),
        DeviceCard(device_name(GPU1), GPU1, 1, 15360),
    ]
)
D0, D1 = device_name(GPU0), device_name(GPU1)


def claim(results, requests=None, uid="uid-1"):
    requests = requests or [{"name": "gpu", "exactly": {"deviceClassName": "c", "capacity": {
        "requests": {"memory": "4Gi", "cores": "30"}}}}]  # fmt: skip
    return {
        "metadata": {"namespace": "ns", "name": "c1", "uid": uid},
        "spec": {"devices": {"requests": requests}},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def share(device=D0, memory="4Gi", cores="30", request="gpu", share_id="s-1", **extra):
    return {"request": request, "driver": DRIVER, "pool": "node-a", "device": device,
            "shareID": share_id, "consumedCapacity": {"memory": memory, "cores": cores},
            **extra}  # fmt: skip


def demand(obj, uid="uid-1", unit_mib=1024):
    return claim_demand(obj, uid=uid, driver=DRIVER, pool="node-a", devices=DEVICES,
                        unit_mib=unit_mib)  # fmt: skip


def test_a_share_is_read_as_units_and_percent_on_its_card():
    """4Gi + 30 cores on GPU0: 4 units of 1 GiB and 30 %, one card, not whole."""
    found = demand(claim([share()]))
    assert (found.cards, found.whole, found.memory_units, found.core_percent) == (
        (GPU0,), False, 4, 30)  # fmt: skip
    assert found.claim.results == (ClaimResult("gpu", "node-a", D0, "s-1"),)
    assert (found.claim.namespace, found.claim.name, found.claim.uid) == ("ns", "c1", "uid-1")


def test_a_request_naming_no_capacity_gets_the_card_whole():
    """No capacity request: the card whole (the scheduler still wrote a share and the
    defaults); several such results are several whole cards."""
    requests = [{"name": "gpu", "exactly": {"deviceClassName": "c", "count": 2}}]
    found = demand(
        claim([share(memory="15Gi", cores="0"), share(D1, "15Gi", "0", share_id="s-2")], requests)
    )
    assert found.whole and found.cards == (GPU0, GPU1)


def test_a_result_without_a_share_id_is_a_card_given_whole():
    """The scheduler gives a device that is not multi-allocatable whole (no shareID)."""
    result = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": D0}
    assert demand(claim([result])).whole


def test_a_subrequest_is_found_under_its_request():
    """firstAvailable: the result names main/small, whose capacity requests count."""
    requests = [
        {
            "name": "main",
            "firstAvailable": [
                {
                    "name": "small",
                    "deviceClassName": "c",
                    "capacity": {"requests": {"memory": "2Gi"}},
                }
            ],
        }
    ]
    found = demand(claim([share(memory="2Gi", cores="0", request="main/small")], requests))
    assert (found.memory_units, found.core_percent, found.whole) == (2, 0, False)
    assert base_request("main/small") == "main"


def test_other_drivers_results_are_left_to_them():
    """A result of another driver is not this node's to judge."""
    other = share(D1) | {"driver": "other.example.com"}
    assert demand(claim([share(), other])).cards == (GPU0,)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda c: c["metadata"].update(uid="uid-2"), "deleted and made again"),
        (lambda c: c["status"].clear(), "not allocated"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(driver="x"),
         "no allocation result of driver"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(pool="node-b"),
         "publishes pool 'node-a'"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device="gpu-9"),
         "which this node does not have"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(adminAccess=True),
         "admin access"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
            memory="1536Mi"), "multiple of the memory unit"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
            memory="16Gi"), "the card has 15360 MiB"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
            cores="101"), "0 to 100"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
            cores="2.5"), "0 to 100"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
            memory="lots"), "is not a quantity"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].pop(
            "cores"), "no consumed cores"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"].update(
            tpus="1"), "never offered"),
        (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(request="nope"),
         "names no request"),
        (lambda c: c["status"]["allocation"]["devices"]["results"].append(
            share(D1, share_id="s-2")), "one share of one card"),
        (lambda c: c["status"]["allocation"]["devices"]["results"].append(
            share(share_id="s-2")), "several results on one card"),
    ],
)  # fmt: skip
def test_refusals_name_the_claim_and_the_problem(change, words):
    """Every allocation the node cannot honour is a ClaimError naming claim and cause."""
    obj = copy.deepcopy(claim([share()]))
    change(obj)
    with pytest.raises(ClaimError) as refused:
        demand(obj)
    assert "claim ns/c1" in str(refused.value) and words in str(refused.value)


def test_device_names_are_the_lowercased_uuids_and_must_be_dns_labels():
    """Stable across reboots (not the index); a UUID that cannot be a label is refused,
    and two cards with one name too."""
    assert device_name("GPU-ABC") == "gpu-abc"
    with pytest.raises(ValueError, match="DNS label"):
        device_name("GPU-" + "a" * 70)
    with pytest.raises(ValueError, match="both become DRA device"):
        device_cards([DeviceCard("gpu-a", "GPU-A", 0, 1), DeviceCard("gpu-a", "gpu-a", 1, 1)])
