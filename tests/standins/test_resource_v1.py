"""Pins standins.resource_v1, the API server's admission of resource.k8s.io/v1
objects: a valid node-local consumable-capacity slice passes with its quantities made
canonical; each ResourceSlice rule gives its error at the real field path; the 422
message and causes; claims get their defaults and their spec and status rules; a
quantity that does not parse is a decode error; immutable fields stay put."""

from __future__ import annotations

import copy

import pytest

from standins import resource_v1 as rv

SHARE = "5f0e9d8c-1b2a-4c3d-8e7f-6a5b4c3d2e1f"


def gpu(name="gpu-0", memory="15Gi") -> dict:
    return {
        "name": name,
        "allowMultipleAllocations": True,
        "attributes": {
            "uuid": {"string": "GPU-6a7c0d3e-1111-2222-3333-444455556666"},
            "gpushare.aliyun.com/index": {"int": 0},
            "driverVersion": {"version": "535.261.3"},
            "shared": {"bool": True},
        },
        "capacity": {
            "memory": {
                "value": memory,
                "requestPolicy": {
                    "default": "1024Mi",
                    "validRange": {"min": "1Gi", "step": "1Gi", "max": memory},
                },
            },
            "cores": {
                "value": "100",
                "requestPolicy": {"default": "100", "validRange": {"min": "1", "step": "1"}},
            },
        },
    }


def a_slice(**spec) -> dict:
    body = {"driver": "gpushare.aliyun.com", "pool": {"name": "node-a", "generation": 1,
            "resourceSliceCount": 1}, "nodeName": "node-a", "devices": [gpu()]}  # fmt: skip
    body.update(spec)
    return {"metadata": {"name": "node-a-gpushare.aliyun.com-x"}, "spec": body}


def errors_of(kind, obj, old=None, status=False) -> list[tuple[str, str, str]]:
    return [(e.type, e.field, e.body()) for e in rv.admit(kind, obj, old, status)]


def test_a_consumable_capacity_slice_is_valid_and_stored_canonical():
    """The slice gpushare-node will publish passes; 1024Mi is stored as 1Gi."""
    obj = a_slice()
    assert rv.admit(rv.SLICE, obj) == []
    memory = obj["spec"]["devices"][0]["capacity"]["memory"]
    assert memory["requestPolicy"]["default"] == "1Gi"
    assert memory["value"] == "15Gi"


def device(**changes) -> dict:
    d = gpu()
    d.update(changes)
    return d


def policy(**changes) -> dict:
    d = gpu()
    d["capacity"]["memory"]["requestPolicy"] = changes
    return d


CASES = {
    "driver not a subdomain": (a_slice(driver="Bad_Driver"), "Invalid", "spec.driver",
                               "lowercase RFC 1123 subdomain"),
    "driver too long": (a_slice(driver="a" * 64), "TooLong", "spec.driver",
                        "may not be more than 63 bytes"),
    "no driver": (a_slice(driver=""), "Required", "spec.driver", "Required value"),
    "pool count zero": (a_slice(pool={"name": "p", "generation": 0, "resourceSliceCount": 0}),
                        "Invalid", "spec.pool.resourceSliceCount", "must be greater than zero"),
    "pool generation negative": (a_slice(pool={"name": "p", "generation": -1,
                                               "resourceSliceCount": 1}),
                                 "Invalid", "spec.pool.generation",
                                 "greater than or equal to zero"),
    "pool name bad part": (a_slice(pool={"name": "a/B", "generation": 0, "resourceSliceCount": 1}),
                           "Invalid", "spec.pool.name", "subdomain"),
    "pool name too long": (a_slice(pool={"name": "a" * 254, "generation": 0,
                                         "resourceSliceCount": 1}),
                           "TooLong", "spec.pool.name", "253"),
    "no node selection": (a_slice(nodeName=None), "Required", "spec",
                          "exactly one of `nodeName`, `nodeSelector`, `allNodes`"),
    "two node selections": (a_slice(allNodes=True), "Invalid", "spec",
                            "but multiple fields are set"),
    "allNodes false": (a_slice(nodeName=None, allNodes=False), "Invalid", "spec.allNodes",
                       "must be either unset or set to true"),
    "empty nodeName": (a_slice(nodeName=""), "Invalid", "spec.nodeName",
                       "must be either unset or set to a non-empty string"),
    "selector with two terms": (a_slice(nodeName=None,
                                        nodeSelector={"nodeSelectorTerms": [{}, {}]}),
                                "Invalid", "spec.nodeSelector.nodeSelectorTerms",
                                "must have exactly one node selector term"),
    "counters and devices": (a_slice(sharedCounters=[]), "Invalid", "spec",
                             "only one of `sharedCounters` or `devices` is allowed"),
    "129 devices": (a_slice(devices=[gpu(f"gpu-{i}") for i in range(129)]), "TooMany",
                    "spec.devices", "must have at most 128 items"),
    "65 devices with a taint": (
        a_slice(devices=[device(name=f"gpu-{i}", taints=[{"key": "k", "effect": "NoSchedule"}])
                         for i in range(65)]),
        "TooMany", "spec.devices", "must have at most 64 items"),
    "duplicate device": (a_slice(devices=[gpu(), gpu()]), "Duplicate", "spec.devices[1]",
                         '"gpu-0"'),
    "device name not a label": (a_slice(devices=[device(name="GPU_0")]), "Invalid",
                                "spec.devices[0].name", "lowercase RFC 1123 label"),
    "attribute with two values": (
        a_slice(devices=[device(attributes={"a": {"int": 1, "bool": True}})]),
        "Invalid", "spec.devices[0].attributes[a]", "exactly one value must be specified"),
    "attribute with no value": (a_slice(devices=[device(attributes={"a": {}})]), "Invalid",
                                "spec.devices[0].attributes[a]",
                                "exactly one value must be specified"),
    "long string attribute": (a_slice(devices=[device(attributes={"a": {"string": "x" * 65}})]),
                              "TooLong", "spec.devices[0].attributes[a].string", "64 bytes"),
    "bad version attribute": (a_slice(devices=[device(attributes={"v": {"version": "1.2"}})]),
                              "Invalid", "spec.devices[0].attributes[v].version", "semver"),
    "attribute name not a C identifier": (
        a_slice(devices=[device(attributes={"a-b": {"int": 1}})]),
        "Invalid", "spec.devices[0].attributes", "a valid C identifier"),
    "attribute name too long": (
        a_slice(devices=[device(attributes={"a" * 33: {"int": 1}})]),
        "TooLong", "spec.devices[0].attributes", "32 bytes"),
    "attribute domain not a subdomain": (
        a_slice(devices=[device(attributes={"Bad_Domain/a": {"int": 1}})]),
        "Invalid", "spec.devices[0].attributes", "subdomain"),
    "two slashes": (a_slice(devices=[device(attributes={"a/b/c": {"int": 1}})]), "Invalid",
                    "spec.devices[0].attributes", "must not contain more than one slash"),
    "33 attributes and capacities": (
        a_slice(devices=[device(attributes={f"a{i}": {"int": i} for i in range(31)})]),
        "Invalid", "spec.devices[0]",
        "the total number of attributes and capacities must not exceed 32"),
    "policy without multiple allocations": (
        a_slice(devices=[device(allowMultipleAllocations=False)]), "Forbidden",
        "spec.devices[0].capacity[memory].requestPolicy", "allowMultipleAllocations must be true"),
    "both policies": (a_slice(devices=[policy(default="1Gi", validValues=["1Gi"],
                                              validRange={"min": "1Gi"})]),
                      "Forbidden", "spec.devices[0].capacity[memory].requestPolicy",
                      "exactly one policy can be specified"),
    "range without min": (a_slice(devices=[policy(default="1Gi", validRange={"step": "1Gi"})]),
                          "Required",
                          "spec.devices[0].capacity[memory].requestPolicy.validRange.min",
                          "required when validRange is defined"),
    "range without default": (a_slice(devices=[policy(validRange={"min": "1Gi"})]), "Required",
                              "spec.devices[0].capacity[memory].requestPolicy.default",
                              "required when validRange is defined"),
    "min above value": (a_slice(devices=[policy(default="16Gi", validRange={"min": "16Gi"})]),
                        "Invalid", "spec.devices[0].capacity[memory].requestPolicy.validRange.min",
                        "min is larger than capacity value: 15Gi"),
    "default below min": (a_slice(devices=[policy(default="1Gi", validRange={"min": "2Gi"})]),
                          "Invalid",
                          "spec.devices[0].capacity[memory].requestPolicy.validRange.default",
                          "default is less than min: 2Gi"),
    "max above value": (a_slice(devices=[policy(default="1Gi", validRange={"min": "1Gi",
                                                                           "max": "16Gi"})]),
                        "Invalid", "spec.devices[0].capacity[memory].requestPolicy.validRange.max",
                        "max is larger than capacity value"),
    "zero step": (a_slice(devices=[policy(default="1Gi", validRange={"min": "1Gi", "step": "0"})]),
                  "Invalid", "spec.devices[0].capacity[memory].requestPolicy.validRange.step",
                  "must be greater than zero"),
    "default off the step grid": (
        a_slice(devices=[policy(default="1536Mi", validRange={"min": "1Gi", "step": "1Gi"})]),
        "Invalid", "spec.devices[0].capacity[memory].requestPolicy.validRange.step",
        "value is not a multiple of a given step (1Gi) from (1Gi)"),
    "one step beyond the value": (
        a_slice(devices=[policy(default="10Gi", validRange={"min": "10Gi", "step": "8Gi"})]),
        "Invalid", "spec.devices[0].capacity[memory].requestPolicy.validRange.step",
        "one step 18Gi is larger than capacity value: 15Gi"),
    "valid values unsorted": (a_slice(devices=[policy(default="2Gi",
                                                      validValues=["2Gi", "1Gi"])]),
                              "Invalid",
                              "spec.devices[0].capacity[memory].requestPolicy.validValues[1]",
                              "values must be sorted in ascending order"),
    "valid values without the default": (
        a_slice(devices=[policy(default="3Gi", validValues=["1Gi", "2Gi"])]),
        "Invalid", "spec.devices[0].capacity[memory].requestPolicy.validValues",
        "default value is not valid according to the requestPolicy"),
    "eleven valid values": (
        a_slice(devices=[policy(default="1Gi", validValues=[f"{i}Gi" for i in range(1, 12)])]),
        "TooMany", "spec.devices[0].capacity[memory].requestPolicy.validValues",
        "must have at most 10 items"),
    "valid value above the value": (
        a_slice(devices=[policy(default="1Gi", validValues=["1Gi", "16Gi"])]),
        "Invalid", "spec.devices[0].capacity[memory].requestPolicy.validValues[1]",
        "option is larger than capacity value: 15Gi"),
    "duplicate valid values": (
        a_slice(devices=[policy(default="1Gi", validValues=["1Gi", "1024Mi"])]),
        "Duplicate", "spec.devices[0].capacity[memory].requestPolicy.validValues[1]",
        '"1073741824"'),
    "valid values without default": (
        a_slice(devices=[policy(validValues=["1Gi"])]), "Required",
        "spec.devices[0].capacity[memory].requestPolicy.default",
        "required when validValues is defined"),
    "capacity without value": (a_slice(devices=[device(capacity={"memory": {}})]), "Required",
                               "spec.devices[0].capacity[memory].value", "Required value"),
    "device node name without per-device selection": (
        a_slice(devices=[device(nodeName="node-a")]), "Invalid", "spec.devices[0]",
        "can only be set if `perDeviceNodeSelection` is set to true"),
    "per-device selection without a device node": (
        a_slice(nodeName=None, perDeviceNodeSelection=True), "Required", "spec.devices[0]",
        "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required"),
    "taint without effect": (a_slice(devices=[device(taints=[{"key": "k"}])]), "Required",
                             "spec.devices[0].taints[0].effect", "Required value"),
    "binding conditions without failures": (
        a_slice(devices=[device(bindingConditions=["ready"])]), "Invalid",
        "spec.devices[0].bindingFailureConditions",
        "bindingFailureConditions are required to use bindingConditions"),
    "three counter consumptions": (
        a_slice(devices=[device(consumesCounters=[{"counterSet": f"s{i}",
                                                   "counters": {"c": {"value": "1"}}}
                                                  for i in range(3)])]),
        "TooMany", "spec.devices[0].consumesCounters", "must have at most 2 items"),
    "slice name not a subdomain": ({"metadata": {"name": "Bad"}, "spec": a_slice()["spec"]},
                                   "Invalid", "metadata.name", "subdomain"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_slice_rule_is_enforced_at_its_path(case):
    """Every rule of a ResourceSlice spec: the error type, the exact field path and the
    real server's words."""
    obj, kind, field, words = CASES[case]
    found = errors_of(rv.SLICE, copy.deepcopy(obj))
    assert any(t == kind and f == field and words in body for t, f, body in found), found


def test_the_422_message_and_causes():
    """invalid_details: ``<Kind>.resource.k8s.io "<name>" is invalid: <errors>`` (one
    error bare, several in brackets) and one cause per error with reason and field."""
    errors = rv.admit(rv.SLICE, a_slice(driver="", pool={"name": "p", "generation": 0,
                                                          "resourceSliceCount": 0}))  # fmt: skip
    message, details = rv.invalid_details(rv.SLICE, "s", errors)
    assert message == (
        'ResourceSlice.resource.k8s.io "s" is invalid: [spec.driver: Required value, '
        "spec.pool.resourceSliceCount: Invalid value: 0: must be greater than zero]"
    )
    assert details == {
        "name": "s",
        "group": "resource.k8s.io",
        "kind": "ResourceSlice",
        "causes": [
            {"reason": "FieldValueRequired", "message": "Required value", "field": "spec.driver"},
            {
                "reason": "FieldValueInvalid",
                "message": "Invalid value: 0: must be greater than zero",
                "field": "spec.pool.resourceSliceCount",
            },
        ],
    }
    one, _ = rv.invalid_details(rv.SLICE, "s", errors[:1])
    assert one == 'ResourceSlice.resource.k8s.io "s" is invalid: spec.driver: Required value'


def test_a_quantity_that_does_not_parse_is_a_decode_error():
    """A capacity of "lots": DecodeError with the quantity parser's message (a 400)."""
    bad = a_slice(devices=[device(capacity={"memory": {"value": "lots"}})])
    with pytest.raises(rv.DecodeError, match="quantities must match the regular expression"):
        rv.admit(rv.SLICE, bad)


def test_slice_updates_keep_driver_pool_and_node():
    """driver, pool.name and nodeName are immutable; devices may change."""
    old = a_slice()
    rv.admit(rv.SLICE, old)
    moved = a_slice(nodeName="node-b", pool={"name": "other", "generation": 2,
                                              "resourceSliceCount": 1})  # fmt: skip
    found = errors_of(rv.SLICE, moved, old)
    assert ("Invalid", "spec.nodeName", 'Invalid value: "node-b": field is immutable') in found
    assert any(f == "spec.pool.name" and "immutable" in b for _, f, b in found)
    grown = a_slice(devices=[gpu(), gpu("gpu-1")])
    assert rv.admit(rv.SLICE, grown, old) == []


def a_claim(**exactly) -> dict:
    request = {"name": "gpu", "exactly": {"deviceClassName": "gpushare.aliyun.com", **exactly}}
    return {"metadata": {"name": "c", "namespace": "ns", "uid": "u1"},
            "spec": {"devices": {"requests": [request]}}}  # fmt: skip


def test_claims_get_their_defaults_and_canonical_requests():
    """A request without mode and count gets ExactCount and 1; capacity requests are
    stored canonical."""
    claim = a_claim(capacity={"requests": {"memory": "4096Mi"}})
    assert rv.admit(rv.CLAIM, claim) == []
    exact = claim["spec"]["devices"]["requests"][0]["exactly"]
    assert (exact["allocationMode"], exact["count"]) == ("ExactCount", 1)
    assert exact["capacity"]["requests"]["memory"] == "4Gi"


CLAIM_CASES = {
    "no class": (a_claim(deviceClassName=""), "Required",
                 "spec.devices.requests[0].exactly.deviceClassName"),
    "count zero": (a_claim(count=0), "Invalid", "spec.devices.requests[0].exactly.count"),
    "count with All": (a_claim(allocationMode="All", count=2), "Invalid",
                       "spec.devices.requests[0].exactly.count"),
    "unknown mode": (a_claim(allocationMode="Some"), "NotSupported",
                     "spec.devices.requests[0].exactly.allocationMode"),
    "selector without cel": (a_claim(selectors=[{}]), "Required",
                             "spec.devices.requests[0].exactly.selectors[0].cel"),
    "long cel": (a_claim(selectors=[{"cel": {"expression": "x" * 10241}}]), "TooLong",
                 "spec.devices.requests[0].exactly.selectors[0].cel.expression"),
    "bad capacity name": (a_claim(capacity={"requests": {"a-b": "1"}}), "Invalid",
                          "spec.devices.requests[0].exactly.capacity.requests"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CLAIM_CASES))
def test_claim_spec_rules(case):
    """The request rules of a claim spec, at their paths."""
    obj, kind, field = CLAIM_CASES[case]
    assert any(t == kind and f == field for t, f, _ in errors_of(rv.CLAIM, obj)), case


def test_claim_request_shape_rules():
    """Neither exactly nor firstAvailable, or both; too many requests; a constraint or
    config naming an unknown request; opaque config that is not an object."""
    claim = a_claim()
    claim["spec"]["devices"]["requests"].append({"name": "x"})
    assert ("Required", "spec.devices.requests[1]") in [e[:2] for e in errors_of(rv.CLAIM, claim)]
    claim = a_claim()
    claim["spec"]["devices"]["requests"] = [dict(claim["spec"]["devices"]["requests"][0],
                                                 name=f"r{i}") for i in range(33)]  # fmt: skip
    assert ("TooMany", "spec.devices.requests") in [e[:2] for e in errors_of(rv.CLAIM, claim)]
    claim = a_claim()
    claim["spec"]["devices"]["config"] = [
        {"requests": ["nope"], "opaque": {"driver": "d.io", "parameters": [1]}}
    ]
    found = [e[:2] for e in errors_of(rv.CLAIM, claim)]
    assert ("Invalid", "spec.devices.config[0].requests[0]") in found
    assert ("Invalid", "spec.devices.config[0].opaque.parameters") in found


def allocated(claim: dict, **result) -> dict:
    claim = copy.deepcopy(claim)
    rv.admit(rv.CLAIM, claim)
    old = copy.deepcopy(claim)
    entry = {"request": "gpu", "driver": "gpushare.aliyun.com", "pool": "node-a",
             "device": "gpu-0", "shareID": SHARE,
             "consumedCapacity": {"memory": "4096Mi"}}  # fmt: skip
    entry.update(result)
    claim["status"] = {
        "allocation": {"devices": {"results": [entry]}},
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-uid"}],
    }
    return old, claim


def test_a_scheduler_allocation_is_a_valid_status_update():
    """The status kube-scheduler writes passes, consumedCapacity stored canonical."""
    old, claim = allocated(a_claim())
    assert rv.admit(rv.CLAIM, claim, old, status=True) == []
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert result["consumedCapacity"]["memory"] == "4Gi"


@pytest.mark.parametrize(
    ("change", "kind", "field"),
    [
        ({"shareID": SHARE.upper()}, "Invalid", "status.allocation.devices.results[0].shareID"),
        ({"shareID": "not-a-uuid"}, "Invalid", "status.allocation.devices.results[0].shareID"),
        ({"request": "other"}, "Invalid", "status.allocation.devices.results[0].request"),
        ({"device": "GPU"}, "Invalid", "status.allocation.devices.results[0].device"),
        ({"driver": ""}, "Required", "status.allocation.devices.results[0].driver"),
    ],
)
def test_bad_allocation_results(change, kind, field):
    """A result whose shareID is no normalized UUID, whose request is not the claim's,
    or whose device or driver is malformed."""
    old, claim = allocated(a_claim(), **change)
    assert (kind, field) in [e[:2] for e in errors_of(rv.CLAIM, claim, old, status=True)]


def test_status_rules():
    """reservedFor only with an allocation and unique; an allocation cannot change once
    set; a device status must name an allocated device and carry a JSON object."""
    old, claim = allocated(a_claim())
    unallocated = copy.deepcopy(claim)
    del unallocated["status"]["allocation"]
    assert ("Forbidden", "status.reservedFor") in [
        e[:2] for e in errors_of(rv.CLAIM, unallocated, old, status=True)
    ]
    twice = copy.deepcopy(claim)
    twice["status"]["reservedFor"] *= 2
    assert ("Duplicate", "status.reservedFor[1]") in [
        e[:2] for e in errors_of(rv.CLAIM, twice, old, status=True)
    ]
    rv.admit(rv.CLAIM, claim, old, status=True)
    changed = copy.deepcopy(claim)
    changed["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-1"
    assert ("Invalid", "status.allocation") in [
        e[:2] for e in errors_of(rv.CLAIM, changed, claim, status=True)
    ]
    reported = copy.deepcopy(claim)
    reported["status"]["devices"] = [
        {"driver": "gpushare.aliyun.com", "pool": "node-a", "device": "gpu-1", "shareID": SHARE,
         "data": [1]}
    ]  # fmt: skip
    found = [e[:2] for e in errors_of(rv.CLAIM, reported, claim, status=True)]
    assert ("Invalid", "status.devices[0]") in found
    assert ("Invalid", "status.devices[0].data") in found
    reported["status"]["devices"][0].update(device="gpu-0", data={"ok": True})
    assert rv.admit(rv.CLAIM, reported, claim, status=True) == []


def test_claim_and_template_specs_are_immutable():
    """An update changing a claim's or a template's spec: field is immutable."""
    claim = a_claim()
    rv.admit(rv.CLAIM, claim)
    changed = copy.deepcopy(claim)
    changed["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    assert [e[:2] for e in errors_of(rv.CLAIM, changed, claim)] == [("Invalid", "spec")]
    template = {"metadata": {"name": "t"}, "spec": {"spec": a_claim()["spec"]}}
    assert rv.admit(rv.TEMPLATE, template) == []
    broken = {"metadata": {"name": "t"}, "spec": {"spec": a_claim(deviceClassName="")["spec"]}}
    assert ("Required", "spec.spec.devices.requests[0].exactly.deviceClassName") in [
        e[:2] for e in errors_of(rv.TEMPLATE, broken)
    ]


def test_device_class_rules():
    """A class's selectors need CEL, its config an opaque driver, its extended resource
    name must be one."""
    selector = {"cel": {"expression": 'device.driver == "gpushare.aliyun.com"'}}
    good = {"metadata": {"name": "gpushare.aliyun.com"}, "spec": {"selectors": [selector]}}
    assert rv.admit(rv.CLASS, good) == []
    bad = {"metadata": {"name": "c"}, "spec": {"selectors": [{}], "config": [{}],
                                               "extendedResourceName": "gpu"}}  # fmt: skip
    found = [e[:2] for e in errors_of(rv.CLASS, bad)]
    assert ("Required", "spec.selectors[0].cel") in found
    assert ("Required", "spec.config[0].opaque") in found
    assert ("Invalid", "spec.extendedResourceName") in found
