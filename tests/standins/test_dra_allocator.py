"""Pins standins.dra_allocator, claims allocated the way kube-scheduler writes
them: the consumed amount of every capacity under each request policy, shares of one
multi-allocatable device summed against its capacity, whole devices without shareID,
pools (newest generation, complete, this node), firstAvailable, count, config,
nodeSelector and reservedFor; and that what it writes is a valid status update."""

from __future__ import annotations

import copy
import itertools
import uuid

import pytest

from standins import dra_allocator as alloc
from standins import resource_v1 as rv

DRIVER = "gpushare.aliyun.com"
NODE = "node-a"


def shared_gpu(name="gpu-0", memory="16Gi", memory_policy=None, cores_policy=None) -> dict:
    memory_policy = memory_policy or {
        "default": "1Gi",
        "validRange": {"min": "1Gi", "step": "1Gi", "max": memory},
    }
    cores_policy = cores_policy or {"default": "100", "validRange": {"min": "1", "step": "1"}}
    return {
        "name": name,
        "allowMultipleAllocations": True,
        "capacity": {
            "memory": {"value": memory, "requestPolicy": memory_policy},
            "cores": {"value": "100", "requestPolicy": cores_policy},
        },
    }


def a_slice(devices, node=NODE, pool=NODE, generation=1, count=1, name=None) -> dict:
    spec = {"driver": DRIVER, "pool": {"name": pool, "generation": generation,
            "resourceSliceCount": count}, "devices": devices}  # fmt: skip
    spec |= {"nodeName": node} if node else {"allNodes": True}
    obj = {"metadata": {"name": name or f"{pool}-{generation}-{len(devices)}"}, "spec": spec}
    rv.admit(rv.SLICE, obj)  # stored as the API server stores it (canonical quantities)
    return obj


def a_claim(name="c", count=1, requests=None, mode=None, uid=None, **exactly) -> dict:
    exact = {"deviceClassName": DRIVER, "count": count, **exactly}
    if requests:
        exact["capacity"] = {"requests": requests}
    if mode:
        exact["allocationMode"] = mode
        exact.pop("count")
    claim = {
        "metadata": {"name": name, "namespace": "ns", "uid": uid or str(uuid.uuid4())},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exact}]}},
    }
    rv.admit(rv.CLAIM, claim)
    return claim


def pod(name="p") -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"}}


def consumed(device, requests):
    out = alloc.consumed_capacity(device, requests)
    return None if out is None else {k: str(v) for k, v in out.items()}


def test_consumed_capacity_follows_the_request_policy():
    """Not requested: the default; no default: the whole value; no policy: the amount;
    validRange: at least min, rounded up to min+n*step; validValues: the smallest one at
    least the request; an amount the policy cannot take, or a capacity the device lacks:
    None (the device is not eligible)."""
    gpu = a_slice([shared_gpu()])["spec"]["devices"][0]
    assert consumed(gpu, None) == {"memory": "1Gi", "cores": "100"}
    assert consumed(gpu, {"memory": "1536Mi", "cores": "30"}) == {"memory": "2Gi", "cores": "30"}
    assert consumed(gpu, {"memory": "100Mi"}) == {"memory": "1Gi", "cores": "100"}
    assert consumed(gpu, {"memory": "17Gi"}) is None  # above max
    assert consumed(gpu, {"bandwidth": "1"}) is None
    no_default = {"name": "d", "capacity": {"memory": {"value": "16Gi"}}}
    assert consumed(no_default, None) == {"memory": "16Gi"}
    assert consumed(no_default, {"memory": "3Gi"}) == {"memory": "3Gi"}
    listed = a_slice([shared_gpu(memory_policy={"default": "4Gi", "validValues": ["4Gi", "8Gi"]})])
    listed = listed["spec"]["devices"][0]
    assert consumed(listed, {"memory": "5Gi"})["memory"] == "8Gi"
    assert consumed(listed, {"memory": "9Gi"}) is None
    stepless = {"default": "2Gi", "validRange": {"min": "2Gi"}}
    unstepped = {"name": "d", "capacity": {"memory": {"value": "16Gi", "requestPolicy": stepless}}}
    assert consumed(unstepped, {"memory": "3000Mi"}) == {"memory": "3000Mi"}


def test_two_claims_share_one_device_with_their_own_share_ids():
    """Each allocation of a multi-allocatable device: a fresh UUID shareID and the amount
    of every capacity; the second claim lands on the same card while it fits."""
    slices = [a_slice([shared_gpu()])]
    first = a_claim("a", requests={"memory": "4Gi", "cores": "30"})
    first["status"] = alloc.allocate(first, slices, [], NODE, pod("pa"))
    second = a_claim("b", requests={"memory": "12Gi", "cores": "70"})
    second["status"] = alloc.allocate(second, slices, [first], NODE, pod("pb"))
    [r1] = first["status"]["allocation"]["devices"]["results"]
    [r2] = second["status"]["allocation"]["devices"]["results"]
    assert (r1["device"], r2["device"]) == ("gpu-0", "gpu-0")
    assert r1["shareID"] != r2["shareID"]
    for r in (r1, r2):
        assert str(uuid.UUID(r["shareID"])) == r["shareID"]
    amounts = {"memory": "4Gi", "cores": "30"}
    assert r1 == {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
                  "shareID": r1["shareID"], "consumedCapacity": amounts}  # fmt: skip
    assert first["status"]["reservedFor"] == [{"resource": "pods", "name": "pa", "uid": "uid-pa"}]


def test_shares_are_summed_against_each_capacity():
    """With 16Gi and 100 cores held 4Gi/30 and 12Gi/70, a claim asking 1Gi (cores
    default 100) does not fit: the next card gets it, and with no next card it fails."""
    held = [a_claim("a", requests={"memory": "4Gi", "cores": "30"}),
            a_claim("b", requests={"memory": "12Gi", "cores": "70"})]  # fmt: skip
    one_card = [a_slice([shared_gpu()])]
    for claim in held:
        claim["status"] = alloc.allocate(claim, one_card, held, NODE)
    late = a_claim("c", requests={"memory": "1Gi"})
    with pytest.raises(alloc.AllocationError, match="0 of 1"):
        alloc.allocate(late, one_card, held, NODE)
    two_cards = [a_slice([shared_gpu(), shared_gpu("gpu-1")])]
    result = alloc.allocate(late, two_cards, held, NODE)["allocation"]["devices"]["results"][0]
    assert result["device"] == "gpu-1"
    assert result["consumedCapacity"] == {"memory": "1Gi", "cores": "100"}


def test_one_claims_own_results_count_in_flight():
    """Two requests of one claim on one card: the second sees the first's amounts."""
    claim = a_claim(requests={"memory": "10Gi", "cores": "10"})
    claim["spec"]["devices"]["requests"].append(
        copy.deepcopy(claim["spec"]["devices"]["requests"][0]) | {"name": "more"}
    )
    slices = [a_slice([shared_gpu(), shared_gpu("gpu-1")])]
    results = alloc.allocate(claim, slices, [], NODE)["allocation"]["devices"]["results"]
    assert [(r["request"], r["device"]) for r in results] == [("gpu", "gpu-0"), ("more", "gpu-1")]


def test_count_never_takes_one_device_twice():
    """count 2 on one multi-allocatable card: refused; on two cards: one share each."""
    claim = a_claim(count=2, requests={"memory": "1Gi", "cores": "1"})
    with pytest.raises(alloc.AllocationError):
        alloc.allocate(claim, [a_slice([shared_gpu()])], [], NODE)
    two = [a_slice([shared_gpu(), shared_gpu("gpu-1")])]
    results = alloc.allocate(claim, two, [], NODE)["allocation"]["devices"]["results"]
    assert sorted(r["device"] for r in results) == ["gpu-0", "gpu-1"]


def test_a_plain_device_is_given_whole():
    """Without allowMultipleAllocations: no shareID, no consumedCapacity, and nobody
    else gets the device; capacity requests only filter."""
    whole = {"name": "gpu-0", "capacity": {"memory": {"value": "16Gi"}}}
    slices = [a_slice([whole])]
    first = a_claim("a", requests={"memory": "8Gi"})
    first["status"] = alloc.allocate(first, slices, [], NODE)
    assert first["status"]["allocation"]["devices"]["results"] == [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}
    ]
    with pytest.raises(alloc.AllocationError):
        alloc.allocate(a_claim("b"), slices, [first], NODE)
    with pytest.raises(alloc.AllocationError):
        alloc.allocate(a_claim("c", requests={"memory": "32Gi"}), slices, [], NODE)


def test_pools_newest_complete_and_on_this_node():
    """An older generation, an incomplete pool and another node's pool are not used."""
    old = a_slice([shared_gpu("old")], generation=1, name="s-old")
    new = a_slice([shared_gpu("new")], generation=2, name="s-new")
    partial = a_slice([shared_gpu("lonely")], pool="p2", count=2, name="s-partial")
    elsewhere = a_slice([shared_gpu("far")], node="node-b", pool="node-b", name="s-far")
    everywhere = a_slice([shared_gpu("net")], node=None, pool="net", name="s-net")
    claim = a_claim(mode="All")
    results = alloc.allocate(claim, [old, new, partial, elsewhere, everywhere], [], NODE)
    devices = sorted(r["device"] for r in results["allocation"]["devices"]["results"])
    assert devices == ["net", "new"]


def test_first_available_records_the_subrequest():
    """The first subrequest that fits wins: the result's request is main/sub."""
    claim = a_claim()
    claim["spec"]["devices"]["requests"] = [{"name": "main", "firstAvailable": [
        {"name": "big", "deviceClassName": DRIVER, "count": 1,
         "capacity": {"requests": {"memory": "64Gi"}}},
        {"name": "small", "deviceClassName": DRIVER, "count": 1,
         "capacity": {"requests": {"memory": "2Gi"}}}]}]  # fmt: skip
    rv.admit(rv.CLAIM, claim)
    result = alloc.allocate(claim, [a_slice([shared_gpu()])], [], NODE)
    [entry] = result["allocation"]["devices"]["results"]
    assert (entry["request"], entry["consumedCapacity"]["memory"]) == ("main/small", "2Gi")


def test_config_selectors_and_node_selector():
    """Class config (FromClass, for the request) before claim config (FromClaim); a
    class selector on the driver picks its devices; a node-local pool pins the node."""
    classes = {DRIVER: {"spec": {
        "selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}],
        "config": [{"opaque": {"driver": DRIVER, "parameters": {"from": "class"}}}]}}}  # fmt: skip
    claim = a_claim()
    claim["spec"]["devices"]["config"] = [
        {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"from": "claim"}}}
    ]
    allocation = alloc.allocate(claim, [a_slice([shared_gpu()])], [], NODE, classes=classes)[
        "allocation"
    ]
    assert allocation["devices"]["config"] == [
        {"source": "FromClass", "requests": ["gpu"],
         "opaque": {"driver": DRIVER, "parameters": {"from": "class"}}},
        {"source": "FromClaim", "requests": ["gpu"],
         "opaque": {"driver": DRIVER, "parameters": {"from": "claim"}}},
    ]  # fmt: skip
    assert allocation["nodeSelector"] == {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}  # fmt: skip
    other = {DRIVER: {"spec": {"selectors": [{"cel": {"expression": 'device.driver == "x.io"'}}]}}}
    with pytest.raises(alloc.AllocationError):
        alloc.allocate(claim, [a_slice([shared_gpu()])], [], NODE, classes=other)
    cel = {DRIVER: {"spec": {"selectors": [{"cel": {"expression": "device.capacity.x > 1"}}]}}}
    with pytest.raises(alloc.AllocationError, match="not supported"):
        alloc.allocate(claim, [a_slice([shared_gpu()])], [], NODE, classes=cel)


def test_reserve_adds_a_pod_once():
    """A shared claim's second pod joins reservedFor; the same pod again changes nothing."""
    claim = a_claim()
    claim["status"] = alloc.allocate(claim, [a_slice([shared_gpu()])], [], NODE, pod("a"))
    claim["status"] = alloc.reserve(claim, pod("b"))
    assert alloc.reserve(claim, pod("b"))["reservedFor"] == claim["status"]["reservedFor"]
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["a", "b"]


def test_what_it_writes_is_a_valid_status_update():
    """The status passes the API server's validation (standins.resource_v1)."""
    ids = (f"5f0e9d8c-1b2a-4c3d-8e7f-{n:012x}" for n in itertools.count())
    claim = a_claim(count=2, requests={"memory": "3Gi", "cores": "25"})
    old = copy.deepcopy(claim)
    slices = [a_slice([shared_gpu(), shared_gpu("gpu-1")])]
    claim["status"] = alloc.allocate(claim, slices, [], NODE, pod(), new_share_id=lambda: next(ids))
    assert rv.admit(rv.CLAIM, claim, old, status=True) == []
    shares = [r["shareID"] for r in claim["status"]["allocation"]["devices"]["results"]]
    assert shares == [
        "5f0e9d8c-1b2a-4c3d-8e7f-000000000000",
        "5f0e9d8c-1b2a-4c3d-8e7f-000000000001",
    ]
