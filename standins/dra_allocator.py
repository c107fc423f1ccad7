"""A ResourceClaim's allocation, written the way kube-scheduler's structured allocator
writes it (k8s.io/dynamic-resource-allocation ``structured``; its consumable-capacity
rules in ``internal/incubating/consumable_capacity.go``). Pure: the claim, the
ResourceSlices and the other claims go in, the claim's new ``status`` comes out.

What it does, as the scheduler with DRAConsumableCapacity on (Kubernetes 1.36):

* pools: slices grouped by driver and pool; only the highest generation counts, and a
  pool counts only when all ``resourceSliceCount`` slices of it are there; a slice
  serves the node when its ``nodeName`` is the node or ``allNodes`` is set (or, with
  ``perDeviceNodeSelection``, the device's own ``nodeName``/``allNodes``);
* requests in order, ``exactly`` (ExactCount ``count`` devices, or All) and
  ``firstAvailable`` (the first subrequest that fits wins, recorded as
  ``<request>/<subrequest>``); one request never takes one device twice;
* a device without ``allowMultipleAllocations`` is taken whole: it must be unused by
  every other claim and by this claim's earlier results; capacity requests only
  filter; its result has no shareID and no consumedCapacity;
* a device with it: a request naming a capacity the device lacks never gets it; the
  amount consumed of **every** capacity is ``consumed_capacity`` (default when not
  requested, raw without a policy, validRange rounded up to min+n*step, validValues
  the smallest one at least the request); the device is skipped when that amount
  breaks the policy or when what other claims hold plus this claim's earlier results
  plus it exceeds the capacity's value; the result gets a fresh UUID shareID and the
  consumedCapacity;
* a device held by a result without shareID (and not adminAccess) is used up;
* class config (``FromClass``, for the requests of that class) then claim config
  (``FromClaim``) go into ``allocation.devices.config``; a node-local pool gives the
  allocation the node's nodeSelector; ``reservedFor`` gets the pod.

Not done: CEL. A selector (the class's or the request's) is honoured only in the form
``device.driver == "<name>"``; anything else raises, unless ``match`` decides instead.
adminAccess, constraints, tolerations and counters are not supported (they raise).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from standins import quantity as qty

_DRIVER_SELECTOR = re.compile(r"""\s*device\.driver\s*==\s*(["'])([^"']*)\1\s*""")

Match = Callable[[dict, dict, dict], bool]  # (device, slice, request) -> eligible


class AllocationError(Exception):
    """The claim cannot be allocated here (no device fits, or a feature not supported)."""


def consumed_capacity(device: dict, requests: dict | None) -> dict[str, qty.Quantity] | None:
    """What one allocation of ``device`` consumes of each of its capacities for these
    capacity requests, or None when the device cannot serve them (a requested capacity
    it lacks, or an amount its request policy does not allow)."""
    capacity = device.get("capacity") or {}
    requests = requests or {}
    if any(name not in capacity for name in requests):
        return None
    out = {}
    for name, cap in capacity.items():
        requested = qty.parse(str(requests[name])) if name in requests else None
        amount = _consumed(requested, cap)
        if _violates(amount, cap.get("requestPolicy")):
            return None
        out[name] = amount
    return out


def _consumed(requested: qty.Quantity | None, cap: dict) -> qty.Quantity:
    policy = cap.get("requestPolicy")
    if requested is None:
        if policy and policy.get("default") is not None:
            return qty.parse(policy["default"])
        return qty.parse(cap["value"])
    if not policy:
        return requested
    valid_range = policy.get("validRange")
    if valid_range and valid_range.get("min") is not None:
        low = qty.parse(valid_range["min"])
        if requested.value < low.value:
            return low
        if valid_range.get("step") is None:
            return requested
        step, base = qty.int_value(qty.parse(valid_range["step"])), qty.int_value(low)
        steps = -(-(qty.int_value(requested) - base) // step)  # rounded up
        return qty.from_int(base + step * steps)
    if policy.get("validValues") is not None:
        for option in map(qty.parse, policy["validValues"]):
            if requested.value <= option.value:
                return option
    return requested


def _violates(amount: qty.Quantity, policy: dict | None) -> bool:
    if not policy:
        return False
    if policy.get("default") is not None and amount.value == qty.parse(policy["default"]).value:
        return False
    valid_range = policy.get("validRange")
    if valid_range is not None:
        if (
            valid_range.get("max") is not None
            and amount.value > qty.parse(valid_range["max"]).value
        ):
            return True
        if valid_range.get("step") is not None:
            step = qty.int_value(qty.parse(valid_range["step"]))
            low = qty.int_value(qty.parse(valid_range["min"]))
            return (qty.int_value(amount) - low) % step != 0
        return False
    if policy.get("validValues"):
        return all(amount.value != qty.parse(v).value for v in policy["validValues"])
    return False


@dataclass
class _Usage:
    """How a device is held: whole by someone, or a sum per capacity of its shares."""

    exclusive: bool = False
    consumed: dict[str, Fraction] = field(default_factory=dict)


def _key(driver: str, pool: str, device: str) -> tuple[str, str, str]:
    return (driver, pool, device)


def usage_of(claims: list[dict]) -> dict[tuple[str, str, str], _Usage]:
    """What the allocations of these claims hold, per (driver, pool, device)."""
    usage: dict[tuple[str, str, str], _Usage] = {}
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            held = usage.setdefault(
                _key(result["driver"], result["pool"], result["device"]), _Usage()
            )
            if result.get("shareID"):
                for name, amount in (result.get("consumedCapacity") or {}).items():
                    held.consumed[name] = (
                        held.consumed.get(name, Fraction(0)) + qty.parse(amount).value
                    )
            elif not result.get("adminAccess"):
                held.exclusive = True
    return usage


def _pools(slices: list[dict], node: str) -> list[tuple[dict, dict]]:
    """(slice, device) of every complete, newest pool, for devices serving ``node``."""
    newest: dict[tuple[str, str], int] = {}
    for s in slices:
        spec = s["spec"]
        pool = (spec["driver"], spec["pool"]["name"])
        newest[pool] = max(newest.get(pool, -1), spec["pool"]["generation"])
    current = [
        s
        for s in slices
        if s["spec"]["pool"]["generation"]
        == newest[(s["spec"]["driver"], s["spec"]["pool"]["name"])]
    ]
    out = []
    for s in sorted(
        current,
        key=lambda s: (s["spec"]["driver"], s["spec"]["pool"]["name"], s["metadata"]["name"]),
    ):
        spec = s["spec"]
        siblings = [
            o
            for o in current
            if (o["spec"]["driver"], o["spec"]["pool"]["name"])
            == (spec["driver"], spec["pool"]["name"])
        ]
        if len(siblings) != spec["pool"]["resourceSliceCount"]:
            continue  # an incomplete pool is not used
        for device in spec.get("devices") or []:
            if _serves(spec, device, node):
                out.append((s, device))
    return out


def _serves(spec: dict, device: dict, node: str) -> bool:
    if spec.get("perDeviceNodeSelection"):
        return device.get("nodeName") == node or device.get("allNodes") is True
    return spec.get("nodeName") == node or spec.get("allNodes") is True


def _selected(selectors: list, device: dict, slice_: dict) -> bool:
    for selector in selectors or []:
        expression = (selector.get("cel") or {}).get("expression", "")
        found = _DRIVER_SELECTOR.fullmatch(expression)
        if not found:
            raise AllocationError(
                f"CEL selector {expression!r} is not supported by the test allocator "
                '(only device.driver == "<name>"): pass match='
            )
        if found.group(2) != slice_["spec"]["driver"]:
            return False
    return True


@dataclass
class _State:
    usage: dict[tuple[str, str, str], _Usage]
    results: list[dict] = field(default_factory=list)
    in_flight: dict[tuple[str, str, str], dict[str, Fraction]] = field(default_factory=dict)
    taken_whole: set[tuple[str, str, str]] = field(default_factory=set)


def allocate(
    claim: dict,
    slices: list[dict],
    claims: list[dict],
    node: str,
    pod: dict | None = None,
    classes: dict[str, dict] | None = None,
    match: Match | None = None,
    new_share_id: Callable[[], str] = lambda: str(uuid.uuid4()),
) -> dict:
    """The claim's new ``status``: ``allocation`` and, with ``pod``, ``reservedFor``.

    ``claims``: the other claims (their allocations hold devices); ``classes``: the
    DeviceClasses by name (their selectors and config apply); ``match``: decides
    eligibility instead of the selectors. Raises AllocationError when a request cannot
    be met."""
    classes = classes or {}
    spec = (claim.get("spec") or {}).get("devices") or {}
    if spec.get("constraints"):
        raise AllocationError("constraints are not supported by the test allocator")
    candidates = _pools(slices, node)
    state = _State(
        usage_of([c for c in claims if c["metadata"].get("uid") != claim["metadata"].get("uid")])
    )
    class_config = []
    for request in spec.get("requests") or []:
        if request.get("exactly") is not None:
            _fill(request["name"], request["exactly"], candidates, state, classes, match)
            class_config += _class_config(request["exactly"], request["name"], classes)
            continue
        for sub in request.get("firstAvailable") or []:
            name = f"{request['name']}/{sub['name']}"
            saved = (
                list(state.results),
                {k: dict(v) for k, v in state.in_flight.items()},
                set(state.taken_whole),
            )
            try:
                _fill(name, sub, candidates, state, classes, match)
            except AllocationError:
                state.results, state.in_flight, state.taken_whole = saved
                continue
            class_config += _class_config(sub, name, classes)
            break
        else:
            raise AllocationError(f"request {request['name']}: no subrequest can be satisfied")
    results = state.results
    for result in results:
        if "consumedCapacity" in result:
            result["shareID"] = new_share_id()
    config = class_config + [
        {
            "source": "FromClaim",
            **({"requests": c["requests"]} if c.get("requests") else {}),
            "opaque": c["opaque"],
        }
        for c in spec.get("config") or []
    ]
    allocation: dict = {"devices": {"results": results}}
    if config:
        allocation["devices"]["config"] = config
    local = {r["pool"] for r in results if _slice_of(slices, r).get("nodeName")}
    if local:
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        allocation["nodeSelector"] = {"nodeSelectorTerms": [term]}
    status: dict = {"allocation": allocation}
    if pod is not None:
        status["reservedFor"] = [_consumer(pod)]
    return status


def _consumer(pod: dict) -> dict:
    meta = pod["metadata"]
    return {"resource": "pods", "name": meta["name"], "uid": meta["uid"]}


def reserve(claim: dict, pod: dict) -> dict:
    """The claim's status with ``pod`` added to ``reservedFor`` (a shared claim)."""
    status = dict(claim.get("status") or {})
    reserved = list(status.get("reservedFor") or [])
    if all(r["uid"] != pod["metadata"]["uid"] for r in reserved):
        reserved.append(_consumer(pod))
    status["reservedFor"] = reserved
    return status


def _slice_of(slices: list[dict], result: dict) -> dict:
    for s in slices:
        spec = s["spec"]
        if spec["driver"] == result["driver"] and spec["pool"]["name"] == result["pool"]:
            return spec
    return {}


def _class_config(exact: dict, request: str, classes: dict[str, dict]) -> list[dict]:
    device_class = classes.get(exact.get("deviceClassName", ""), {})
    return [
        {"source": "FromClass", "requests": [request], "opaque": c["opaque"]}
        for c in (device_class.get("spec") or {}).get("config") or []
    ]


def _fill(name, exact, candidates, state: _State, classes, match: Match | None) -> None:
    if exact.get("adminAccess") or exact.get("tolerations"):
        raise AllocationError(f"request {name}: adminAccess and tolerations are not supported")
    device_class = classes.get(exact.get("deviceClassName", ""))
    if classes and device_class is None:
        raise AllocationError(
            f"request {name}: DeviceClass {exact.get('deviceClassName')!r} not found"
        )
    selectors = ((device_class or {}).get("spec") or {}).get("selectors") or []
    selectors = selectors + (exact.get("selectors") or [])
    wanted = None if exact.get("allocationMode") == "All" else exact.get("count", 1)
    requests = (exact.get("capacity") or {}).get("requests")
    taken_here: set[tuple[str, str, str]] = set()
    for slice_, device in candidates:
        if wanted is not None and len(taken_here) == wanted:
            break
        key = _key(slice_["spec"]["driver"], slice_["spec"]["pool"]["name"], device["name"])
        if key in taken_here:
            continue
        eligible = match(device, slice_, exact) if match else _selected(selectors, device, slice_)
        if not eligible:
            continue
        result = _take(name, key, device, requests, state)
        if result is not None:
            taken_here.add(key)
            state.results.append(result)
    if (wanted is not None and len(taken_here) < wanted) or not taken_here:
        raise AllocationError(
            f"request {name}: {len(taken_here)} of {wanted if wanted is not None else 'all'} "
            "devices found that fit"
        )


def _take(name: str, key, device: dict, requests, state: _State) -> dict | None:
    held = state.usage.get(key, _Usage())
    if held.exclusive or key in state.taken_whole:
        return None
    amounts = consumed_capacity(device, requests)
    if amounts is None:
        return None
    result = {"request": name, "driver": key[0], "pool": key[1], "device": key[2]}
    if not device.get("allowMultipleAllocations"):
        if held.consumed or key in state.in_flight:
            return None  # shares of it are held: it cannot be given whole
        if any(
            qty.parse(str(requests[n])).value > qty.parse(device["capacity"][n]["value"]).value
            for n in requests or {}
        ):
            return None
        state.taken_whole.add(key)
        return result
    flying = dict(state.in_flight.get(key, {}))
    for cap_name, amount in amounts.items():
        flying[cap_name] = flying.get(cap_name, Fraction(0)) + amount.value
        total = held.consumed.get(cap_name, Fraction(0)) + flying[cap_name]
        if total > qty.parse(device["capacity"][cap_name]["value"]).value:
            return None
    state.in_flight[key] = flying
    result["consumedCapacity"] = {n: qty.canonical(a) for n, a in amounts.items()}
    return result
