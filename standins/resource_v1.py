"""``resource.k8s.io/v1`` as the API server admits it: defaults, quantities, validation.

The test API server (standins/apiserver_sim.py) runs every create, update and
patch of a ResourceSlice, ResourceClaim (and its status), DeviceClass and
ResourceClaimTemplate through ``admit``, which does what kube-apiserver does with the
body (pkg/apis/resource/validation/validation.go, the v1 defaults, the Quantity codec):

* quantities (capacity values and request policies, counters, capacity requests,
  consumedCapacity) are parsed as Kubernetes quantities (``standins.quantity``)
  and stored in canonical form; one that does not parse is a decode error (HTTP 400);
* defaults: a request's ``allocationMode`` is ExactCount and its ``count`` 1;
* validation, with the real server's field paths and messages (HTTP 422 with one
  cause per error). A ResourceSlice: driver (a DNS subdomain of at most 63
  characters), pool (name of at most 253 characters of slash-separated DNS
  subdomains, generation >= 0, resourceSliceCount > 0), exactly one of nodeName,
  nodeSelector (one term), allNodes, perDeviceNodeSelection, devices (at most 128, or
  64 with taints, counters or list attributes; unique DNS-label names), attributes
  (exactly one of int/bool/string of at most 64/version (semver)), capacities
  ({value, requestPolicy}; a requestPolicy only with allowMultipleAllocations;
  validValues at most 10, ascending, unique, within the value and holding the
  default; validRange with min, max and step rules and the default and max on the
  step grid), at most 32 attributes and capacities per device, qualified names (a C
  identifier of at most 32, optionally behind a driver-like domain and '/'),
  sharedCounters, taints, counter consumption, per-device node selection, binding
  conditions; driver, pool name and nodeName immutable. A ResourceClaim (and a
  template's inner spec): requests (at most 32, DNS-label names, exactly one of
  exactly/firstAvailable, deviceClassName, allocation mode and count, selectors with a
  CEL expression of at most 10 KiB), constraints and config referring to requests,
  opaque config (driver, a JSON object of at most 10 KiB); the spec is immutable. Its
  status: reservedFor (at most 256, unique UIDs, resource/name/uid, only with an
  allocation), the allocation immutable once set, results (at most 32; request,
  driver, pool, device, shareID a normalized UUID), devices (each an allocated
  device, conditions at most 8, data a JSON object of at most 10 KiB). A DeviceClass:
  selectors, config, extendedResourceName.

Not checked: CEL expressions are not compiled (only their length), node selectors
are taken as they come, nodeAllocatableResources, partitionTypeAttribute and
skipNodeOperations are not looked at, and the gates are those of a 1.36 cluster with
consumable capacity on (no fractional capacity ranges).

Why this module is longer than 400 lines: it is the API server's validation of four
kinds, field by field with the real paths and messages, so that a node writing a bad
ResourceSlice or claim status gets the answer a real cluster gives; splitting it by
kind would split the shared name, quantity and error helpers.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import NamedTuple

from standins import quantity as qty
from standins.kubelet_sim import is_extended_resource_name

GROUP = "resource.k8s.io"
API_VERSION = "resource.k8s.io/v1"
SLICE, CLAIM, CLASS, TEMPLATE = (
    "ResourceSlice",
    "ResourceClaim",
    "DeviceClass",
    "ResourceClaimTemplate",
)

MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64  # with taints, counter consumption or list attributes
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_STRING_ATTRIBUTE = 64
MAX_ID = 32  # the C identifier of a qualified name
MAX_DOMAIN = 63
MAX_DRIVER = 63
MAX_POOL_NAME = 253
MAX_VALID_VALUES = 10
MAX_COUNTER_SETS = 8
MAX_COUNTERS = 32
MAX_COUNTER_CONSUMPTIONS = 2
MAX_TAINTS = 16
MAX_BINDING_CONDITIONS = 4
MAX_REQUESTS = 32  # also the results of an allocation
MAX_CONSTRAINTS = 32
MAX_CONFIG = 32
MAX_SELECTORS = 32
MAX_FIRST_AVAILABLE = 8
MAX_RESERVED_FOR = 256
MAX_CONDITIONS = 8
MAX_CEL = 10 * 1024
MAX_OPAQUE = 10 * 1024
MAX_DATA = 10 * 1024
INT64_MAX = 2**63 - 1

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(_LABEL)
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?"
)
LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
    "regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
    "or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
    "regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
C_IDENTIFIER_MSG = (
    "a valid C identifier must start with alphabetic character or '_', followed by a string "
    "of alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex "
    "used for validation is '[A-Za-z_][A-Za-z0-9_]*')"
)
IMMUTABLE = "field is immutable"
_NODE_SELECTION = (
    "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"
)

# ---------------------------------------------------------------------------- errors

_OMIT = object()  # an error that shows no value
_TYPES = {
    # type: (cause reason, the words the message starts with)
    "Required": ("FieldValueRequired", "Required value"),
    "Invalid": ("FieldValueInvalid", "Invalid value"),
    "Duplicate": ("FieldValueDuplicate", "Duplicate value"),
    "NotSupported": ("FieldValueNotSupported", "Unsupported value"),
    "Forbidden": ("FieldValueForbidden", "Forbidden"),
    "TooLong": ("FieldValueTooLong", "Too long"),
    "TooMany": ("FieldValueTooMany", "Too many"),
}


class FieldError(NamedTuple):
    """One validation error, as apimachinery's field.Error."""

    type: str  # a key of _TYPES
    field: str
    value: object = _OMIT
    detail: str = ""

    @property
    def reason(self) -> str:
        return _TYPES[self.type][0]

    def body(self) -> str:
        words = _TYPES[self.type][1]
        if self.type in ("Required", "Forbidden", "TooLong") or self.value is _OMIT:
            text = words
        else:
            text = f"{words}: {_go_value(self.value)}"
        return f"{text}: {self.detail}" if self.detail else text

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def _go_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


class DecodeError(ValueError):
    """The body cannot be decoded into the kind (a quantity that does not parse): the API
    server answers 400 before any validation."""


def required(field, detail=""):
    return FieldError("Required", field, _OMIT, detail)


def invalid(field, value, detail):
    return FieldError("Invalid", field, value, detail)


def forbidden(field, detail):
    return FieldError("Forbidden", field, _OMIT, detail)


def too_long(field, limit):
    return FieldError("TooLong", field, _OMIT, f"may not be more than {limit} bytes")


def too_many(field, actual, limit):
    return FieldError(
        "TooMany", field, actual, f"must have at most {limit} item{'s' if limit != 1 else ''}"
    )


def duplicate(field, value):
    return FieldError("Duplicate", field, value)


def not_supported(field, value, supported):
    return FieldError(
        "NotSupported",
        field,
        value,
        "supported values: " + ", ".join(json.dumps(s) for s in supported),
    )


def invalid_details(kind: str, name: str, errors: list[FieldError]) -> tuple[str, dict]:
    """The message and details of the 422 Status the API server answers."""
    listed = [str(e) for e in errors]
    joined = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
    message = f'{kind}.{GROUP} "{name}" is invalid: {joined}'
    causes = [{"reason": e.reason, "message": e.body(), "field": e.field} for e in errors]
    return message, {"name": name, "group": GROUP, "kind": kind, "causes": causes}


# ---------------------------------------------------------------------------- admit


def admit(kind: str, obj: dict, old: dict | None = None, status: bool = False) -> list[FieldError]:
    """Default and canonicalize ``obj`` in place, then validate it: the errors (empty: it
    is stored). ``old``: the stored object of an update; ``status``: a status update.
    Raises DecodeError for a quantity that does not parse."""
    _canonicalize(kind, obj)
    if kind in (CLAIM, TEMPLATE):
        _default_claim_spec(_claim_spec_of(kind, obj))
    name = (obj.get("metadata") or {}).get("name", "")
    errors = _name_errors(name)
    if kind == SLICE:
        errors += validate_slice_spec(
            _dict(obj.get("spec")), _dict((old or {}).get("spec")) if old else None
        )
    elif kind == CLASS:
        errors += _class_spec(_dict(obj.get("spec")), "spec")
    elif kind == TEMPLATE:
        errors += _immutable_or(
            old,
            obj,
            "spec",
            lambda: _claim_spec(_dict(_dict(obj.get("spec")).get("spec")), "spec.spec"),
        )
    elif kind == CLAIM and status:
        errors = validate_claim_status(obj, _dict((old or {}).get("status")))
    elif kind == CLAIM:
        errors += _immutable_or(
            old, obj, "spec", lambda: _claim_spec(_dict(obj.get("spec")), "spec")
        )
    return errors


def _immutable_or(old, obj, field, validate: Callable[[], list[FieldError]]) -> list[FieldError]:
    if old is not None:
        if old.get(field) != obj.get(field):
            return [invalid(field, obj.get(field), IMMUTABLE)]
        return []
    return validate()


def _name_errors(name: str) -> list[FieldError]:
    if len(name) > 253:
        return [invalid("metadata.name", name, "must be no more than 253 characters")]
    if not _DNS_SUBDOMAIN.fullmatch(name):
        return [invalid("metadata.name", name, SUBDOMAIN_MSG)]
    return []


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


# ---------------------------------------------------------------------------- quantities


def _canonicalize(kind: str, obj: dict) -> None:
    """Every quantity of the object, parsed and stored in canonical form."""
    if kind == SLICE:
        _canon_slice(_dict(obj.get("spec")))
    elif kind in (CLAIM, TEMPLATE):
        for request in _list(_dict(_claim_spec_of(kind, obj).get("devices")).get("requests")):
            request = _dict(request)
            for exact in [request.get("exactly"), *_list(request.get("firstAvailable"))]:
                _canon_map(_dict(_dict(_dict(exact).get("capacity")).get("requests")))
        allocation = _dict(_dict(obj.get("status")).get("allocation"))
        for result in _list(_dict(allocation.get("devices")).get("results")):
            _canon_map(_dict(_dict(result).get("consumedCapacity")))


def _canon_slice(spec: dict) -> None:
    for device in _list(spec.get("devices")):
        for cap in _dict(_dict(device).get("capacity")).values():
            if isinstance(cap, dict):
                _canon_key(cap, "value")
                policy = _dict(cap.get("requestPolicy"))
                _canon_key(policy, "default")
                if isinstance(policy.get("validValues"), list):
                    policy["validValues"] = [_canon(v) for v in policy["validValues"]]
                for key in ("min", "max", "step"):
                    _canon_key(_dict(policy.get("validRange")), key)
        for consumption in _list(_dict(device).get("consumesCounters")):
            _canon_counters(_dict(consumption).get("counters"))
    for counter_set in _list(spec.get("sharedCounters")):
        _canon_counters(_dict(counter_set).get("counters"))


def _claim_spec_of(kind: str, obj: dict) -> dict:
    spec = obj.setdefault("spec", {}) if isinstance(obj.get("spec", {}), dict) else {}
    if kind == TEMPLATE:
        inner = spec.get("spec", {})
        return inner if isinstance(inner, dict) else {}
    return spec


def _canon(value) -> str:
    try:
        return qty.canonical(qty.from_json(value))
    except qty.QuantityError as e:
        raise DecodeError(str(e)) from None


def _canon_key(holder: dict, key: str) -> None:
    if key in holder and holder[key] is not None:
        holder[key] = _canon(holder[key])


def _canon_map(values: dict) -> None:
    for key in list(values):
        values[key] = _canon(values[key])


def _canon_counters(counters) -> None:
    for counter in _dict(counters).values():
        if isinstance(counter, dict):
            _canon_key(counter, "value")


def _q(text) -> qty.Quantity:
    return qty.parse(text) if isinstance(text, str) else qty.from_json(text)


# ---------------------------------------------------------------------------- names


def driver_name_errors(name, field: str) -> list[FieldError]:
    """A driver name, as a CSI driver's: required, at most 63, a DNS subdomain (checked
    lower-cased, as kube-apiserver does)."""
    if not isinstance(name, str) or not name:
        return [required(field)]
    errors = [too_long(field, MAX_DRIVER)] if len(name) > MAX_DRIVER else []
    if not _DNS_SUBDOMAIN.fullmatch(name.lower()):
        errors.append(invalid(field, name, SUBDOMAIN_MSG))
    return errors


def label_errors(value, field: str) -> list[FieldError]:
    value = value if isinstance(value, str) else ""
    if len(value) > 63:
        return [invalid(field, value, "must be no more than 63 characters")]
    return [] if _DNS_LABEL.fullmatch(value) else [invalid(field, value, LABEL_MSG)]


def subdomain_errors(value, field: str) -> list[FieldError]:
    value = value if isinstance(value, str) else ""
    if len(value) > 253:
        return [invalid(field, value, "must be no more than 253 characters")]
    return [] if _DNS_SUBDOMAIN.fullmatch(value) else [invalid(field, value, SUBDOMAIN_MSG)]


def pool_name_errors(name, field: str) -> list[FieldError]:
    if not isinstance(name, str) or not name:
        return [required(field)]
    errors = [too_long(field, MAX_POOL_NAME)] if len(name) > MAX_POOL_NAME else []
    for part in name.split("/"):
        errors += subdomain_errors(part, field)
    return errors


def qualified_name_errors(name: str, field: str) -> list[FieldError]:
    """An attribute or capacity name: a C identifier of at most 32 characters, optionally
    behind a domain (a valid driver name) and one '/'."""
    parts = name.split("/")
    if len(parts) > 2:
        return [invalid(field, name, "must not contain more than one slash")]
    errors = []
    if len(parts) == 2:
        domain, name = parts
        if not domain:
            errors.append(invalid(field, "", "the domain must not be empty"))
        else:
            errors += driver_name_errors(domain, field)
        if not name:
            return [*errors, invalid(field, "", "the name must not be empty")]
    if len(name) > MAX_ID:
        errors.append(too_long(field, MAX_ID))
    if not _C_IDENTIFIER.fullmatch(name):
        errors.append(invalid(field, name, C_IDENTIFIER_MSG))
    return errors


def _key_path(field: str, key: str) -> str:
    """fldPath.Key(key), the key truncated in the middle past 96 characters."""
    limit = MAX_DOMAIN + 1 + MAX_ID
    if len(key) > limit:
        keep = limit - 3
        key = key[: (keep + 1) // 2] + "..." + key[len(key) - keep // 2 :]
    return f"{field}[{key}]"


def _label_name_errors(name, field: str) -> list[FieldError]:
    """metav1validation.ValidateLabelName: an optional DNS-subdomain prefix and '/', a name
    of at most 63 alphanumerics, '-', '_', '.'."""
    if not isinstance(name, str) or not name:
        return [
            invalid(field, name if isinstance(name, str) else "", "name part must be non-empty")
        ]
    prefix, _, short = name.rpartition("/")
    errors = []
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        errors.append(invalid(field, name, "prefix part " + SUBDOMAIN_MSG))
    if len(short) > 63 or not _LABEL_NAME.fullmatch(short):
        errors.append(
            invalid(
                field,
                name,
                "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
                "start and end with an alphanumeric character",
            )
        )
    return errors


# ---------------------------------------------------------------------------- slices


def validate_slice_spec(spec: dict, old: dict | None) -> list[FieldError]:
    errors = driver_name_errors(spec.get("driver"), "spec.driver")
    pool = _dict(spec.get("pool"))
    errors += pool_name_errors(pool.get("name"), "spec.pool.name")
    count, generation = pool.get("resourceSliceCount", 0), pool.get("generation", 0)
    if not isinstance(count, int) or count <= 0:
        errors.append(invalid("spec.pool.resourceSliceCount", count, "must be greater than zero"))
    if not isinstance(generation, int) or generation < 0:
        errors.append(
            invalid("spec.pool.generation", generation, "must be greater than or equal to zero")
        )
    if old is not None:
        for path, new_value, old_value in (
            ("spec.pool.name", pool.get("name"), _dict(old.get("pool")).get("name")),
            ("spec.driver", spec.get("driver"), old.get("driver")),
            ("spec.nodeName", spec.get("nodeName"), old.get("nodeName")),
        ):
            if new_value != old_value:
                errors.append(invalid(path, new_value, IMMUTABLE))
    errors += _node_selection(spec)
    if spec.get("sharedCounters") is not None and spec.get("devices") is not None:
        errors.append(invalid("spec", "", "only one of `sharedCounters` or `devices` is allowed"))
    devices = _list(spec.get("devices"))
    advanced = any(
        _dict(d).get("taints") or _dict(d).get("consumesCounters") or _has_list_attributes(d)
        for d in devices
    )
    limit = MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES
    old_devices = {
        d.get("name"): d for d in _list((old or {}).get("devices")) if isinstance(d, dict)
    }
    if len(devices) > limit:
        errors.append(too_many("spec.devices", len(devices), limit))
    else:
        per_device = spec.get("perDeviceNodeSelection") is True
        for index, device in enumerate(devices):
            device = _dict(device)
            errors += _device(
                device, old_devices.get(device.get("name")), f"spec.devices[{index}]", per_device
            )
        errors += _duplicates([_dict(d).get("name") for d in devices], "spec.devices")
    counter_sets = _list(spec.get("sharedCounters"))
    if len(counter_sets) > MAX_COUNTER_SETS:
        errors.append(too_many("spec.sharedCounters", len(counter_sets), MAX_COUNTER_SETS))
    else:
        for index, counter_set in enumerate(counter_sets):
            errors += _counter_set(_dict(counter_set), f"spec.sharedCounters[{index}]")
        errors += _duplicates([_dict(c).get("name") for c in counter_sets], "spec.sharedCounters")
    return errors


def _node_selection(spec: dict) -> list[FieldError]:
    errors, chosen = [], []
    if "nodeName" in spec and spec["nodeName"] is not None:
        if spec["nodeName"]:
            chosen.append("`nodeName`")
            errors += subdomain_errors(spec["nodeName"], "spec.nodeName")
        else:
            errors.append(
                invalid("spec.nodeName", "", "must be either unset or set to a non-empty string")
            )
    if spec.get("nodeSelector") is not None:
        chosen.append("`nodeSelector`")
        terms = _list(_dict(spec["nodeSelector"]).get("nodeSelectorTerms"))
        if len(terms) != 1:
            errors.append(
                invalid(
                    "spec.nodeSelector.nodeSelectorTerms",
                    terms,
                    "must have exactly one node selector term",
                )
            )
    for field in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(field) is not None:
            if spec[field] is True:
                chosen.append(f"`{field}`")
            else:
                errors.append(
                    invalid(f"spec.{field}", spec[field], "must be either unset or set to true")
                )
    if not chosen:
        errors.append(required("spec", _NODE_SELECTION))
    elif len(chosen) > 1:
        errors.append(
            invalid(
                "spec",
                "{" + ", ".join(chosen) + "}",
                _NODE_SELECTION + ", but multiple fields are set",
            )
        )
    return errors


def _has_list_attributes(device) -> bool:
    return any(
        any(k in _dict(a) for k in ("bools", "ints", "strings", "versions"))
        for a in _dict(_dict(device).get("attributes")).values()
    )


def _duplicates(keys: list, field: str) -> list[FieldError]:
    seen, errors = set(), []
    for index, key in enumerate(keys):
        marker = json.dumps(key, sort_keys=True)
        if marker in seen:
            errors.append(duplicate(f"{field}[{index}]", key))
        seen.add(marker)
    return errors


def _device(device: dict, old: dict | None, field: str, per_device: bool) -> list[FieldError]:
    errors = label_errors(device.get("name"), f"{field}.name")
    attributes, capacity = _dict(device.get("attributes")), _dict(device.get("capacity"))
    total = len(attributes) + len(capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES:
        errors.append(
            invalid(
                field,
                total,
                "the total number of attributes and capacities must not exceed "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES}",
            )
        )
    values = sum(
        sum(len(_list(a.get(k))) for k in ("bools", "ints", "strings", "versions")) or 1
        for a in map(_dict, attributes.values())
    )
    if values > MAX_ATTRIBUTE_VALUES:
        errors.append(
            invalid(
                field,
                values,
                f"the total number of attribute values must not exceed {MAX_ATTRIBUTE_VALUES}",
            )
        )
    for key, attribute in attributes.items():
        errors += qualified_name_errors(key, f"{field}.attributes")
        errors += _attribute(_dict(attribute), _key_path(f"{field}.attributes", key))
    multiple = device.get("allowMultipleAllocations") is True
    if old is None or _dict(old.get("capacity")) != capacity:
        for key, cap in capacity.items():
            errors += qualified_name_errors(key, f"{field}.capacity")
            errors += _capacity(_dict(cap), _key_path(f"{field}.capacity", key), multiple)
    taints = _list(device.get("taints"))
    if len(taints) > MAX_TAINTS:
        errors.append(too_many(f"{field}.taints", len(taints), MAX_TAINTS))
    else:
        for index, taint in enumerate(taints):
            errors += _taint(_dict(taint), f"{field}.taints[{index}]")
    consumptions = _list(device.get("consumesCounters"))
    if len(consumptions) > MAX_COUNTER_CONSUMPTIONS:
        errors.append(
            too_many(f"{field}.consumesCounters", len(consumptions), MAX_COUNTER_CONSUMPTIONS)
        )
    else:
        for index, consumption in enumerate(consumptions):
            consumption = _dict(consumption)
            where = f"{field}.consumesCounters[{index}]"
            errors += _counters(
                consumption.get("counterSet"), consumption.get("counters"), where, "counterSet"
            )
        errors += _duplicates(
            [_dict(c).get("counterSet") for c in consumptions], f"{field}.consumesCounters"
        )
    errors += _device_nodes(device, field, per_device)
    errors += _binding(device, field)
    return errors


def _attribute(attribute: dict, field: str) -> list[FieldError]:
    errors = []
    present = [k for k in ("int", "bool", "string", "version") if attribute.get(k) is not None]
    present += [k for k in ("ints", "bools", "strings", "versions") if attribute.get(k) is not None]
    kinds = {"int": int, "bool": bool, "string": str, "version": str}
    for key in present:
        value = attribute[key]
        if key in kinds and (
            not isinstance(value, kinds[key]) or (key == "int" and isinstance(value, bool))
        ):
            errors.append(
                invalid(f"{field}.{key}", value, f"must be of type {kinds[key].__name__}")
            )
        elif key in ("string", "version") and len(value) > MAX_STRING_ATTRIBUTE:
            errors.append(too_long(f"{field}.{key}", MAX_STRING_ATTRIBUTE))
        if key == "version" and isinstance(value, str) and not _SEMVER.fullmatch(value):
            errors.append(
                invalid(
                    f"{field}.version",
                    value,
                    "must be a string compatible with semver.org spec 2.0.0",
                )
            )
        if key.endswith("s") and not _list(value):
            errors.append(invalid(f"{field}.{key}", value, "must not be empty if specified"))
    if len(present) != 1:
        errors.append(
            invalid(field, "" if not present else attribute, "exactly one value must be specified")
        )
    return errors


def _capacity(cap: dict, field: str, multiple: bool) -> list[FieldError]:
    if "value" not in cap:
        return [required(f"{field}.value")]
    if cap.get("requestPolicy") is None:
        return []
    if not multiple:
        return [forbidden(f"{field}.requestPolicy", "allowMultipleAllocations must be true")]
    return _request_policy(_q(cap["value"]), _dict(cap["requestPolicy"]), f"{field}.requestPolicy")


def _request_policy(value: qty.Quantity, policy: dict, field: str) -> list[FieldError]:
    valid_values, valid_range = policy.get("validValues"), policy.get("validRange")
    if valid_values and valid_range is not None:
        return [
            forbidden(
                field,
                'exactly one policy can be specified, cannot specify "validValues" and '
                '"validRange" at the same time',
            )
        ]
    default = _q(policy["default"]) if policy.get("default") is not None else None
    if valid_values:
        if default is None:
            return [required(f"{field}.default", "required when validValues is defined")]
        return _valid_values(default, value, [_q(v) for v in valid_values], f"{field}.validValues")
    if valid_range is not None:
        if default is None:
            return [required(f"{field}.default", "required when validRange is defined")]
        return _valid_range(default, value, _dict(valid_range), f"{field}.validRange")
    return []


def _valid_values(default, value, options: list[qty.Quantity], field: str) -> list[FieldError]:
    errors = [
        invalid(
            f"{field}[{i + 1}]", str(options[i + 1]), "values must be sorted in ascending order"
        )
        for i in range(len(options) - 1)
        if options[i].value > options[i + 1].value
    ]
    if len(options) > MAX_VALID_VALUES:
        errors.append(too_many(field, len(options), MAX_VALID_VALUES))
        found = False
    else:
        for index, option in enumerate(options):
            if option.value > value.value:
                errors.append(
                    invalid(
                        f"{field}[{index}]",
                        str(option),
                        f"option is larger than capacity value: {value}",
                    )
                )
        errors += _duplicates([str(qty.int_value(o)) for o in options], field)
        found = any(o.value == default.value for o in options)
    if not found:
        errors.append(
            invalid(
                field, str(default), "default value is not valid according to the requestPolicy"
            )
        )
    return errors


def _valid_range(default, value, valid_range: dict, field: str) -> list[FieldError]:
    if valid_range.get("min") is None:
        return [required(f"{field}.min", "required when validRange is defined")]
    low = _q(valid_range["min"])
    high = _q(valid_range["max"]) if valid_range.get("max") is not None else None
    step = _q(valid_range["step"]) if valid_range.get("step") is not None else None
    errors = []
    if low.value > value.value:
        errors.append(
            invalid(f"{field}.min", str(low), f"min is larger than capacity value: {value}")
        )
    if default.value < low.value:
        errors.append(invalid(f"{field}.default", str(default), f"default is less than min: {low}"))
    if high is not None:
        if low.value > high.value:
            errors.append(invalid(f"{field}.max", str(low), f"min is larger than max: {high}"))
        if high.value > value.value:
            errors.append(
                invalid(f"{field}.max", str(high), f"max is larger than capacity value: {value}")
            )
        if default.value > high.value:
            errors.append(
                invalid(f"{field}.default", str(default), f"default is more than max: {high}")
            )
    if step is None:
        return errors
    return errors + _range_step(default, value, low, high, step, field)


def _range_step(default, value, low, high, step, field: str) -> list[FieldError]:
    """The step of a validRange: positive, one step fits the capacity, and the default and
    max on the min+n*step grid (int64 arithmetic, as without fractional ranges)."""
    if step.value <= 0:
        return [invalid(f"{field}.step", str(step), "must be greater than zero")]
    errors = []
    if low.value + step.value > value.value:
        errors.append(
            invalid(
                f"{field}.step",
                str(step),
                f"one step {qty.Quantity(low.value + step.value, low.format)} is larger than "
                f"capacity value: {value}",
            )
        )
    unsafe = False
    for name, q in (("default", default), ("min", low), ("max", high), ("step", step)):
        if q is not None and q.value < 0:
            errors.append(invalid(f"{field}.{name}", str(q), "must be greater than or equal to 0"))
            unsafe = True
        elif q is not None and q.value > INT64_MAX:
            errors.append(
                invalid(f"{field}.{name}", str(q), f"must not be larger than {INT64_MAX}")
            )
            unsafe = True
    if unsafe:
        return errors
    for checked in (default, high):
        offset = qty.int_value(checked) - qty.int_value(low) if checked is not None else 0
        if _go_rem(offset, qty.int_value(step)):
            errors.append(
                invalid(
                    f"{field}.step",
                    str(checked),
                    f"value is not a multiple of a given step ({step}) from ({low})",
                )
            )
    return errors


def _go_rem(a: int, b: int) -> int:
    """Go's % on integers (the sign of the dividend), not Python's."""
    rest = abs(a) % abs(b)
    return -rest if a < 0 else rest


def _taint(taint: dict, field: str) -> list[FieldError]:
    errors = _label_name_errors(taint.get("key"), f"{field}.key")
    effect = taint.get("effect")
    if not effect:
        errors.append(required(f"{field}.effect"))
    elif effect not in ("NoExecute", "NoSchedule", "None"):
        errors.append(not_supported(f"{field}.effect", effect, ["NoExecute", "NoSchedule", "None"]))
    return errors


def _counter_set(counter_set: dict, field: str) -> list[FieldError]:
    return _counters(counter_set.get("name"), counter_set.get("counters"), field, "name")


def _counters(name, counters, field: str, name_field: str) -> list[FieldError]:
    errors = (
        [required(f"{field}.{name_field}")]
        if not name
        else label_errors(name, f"{field}.{name_field}")
    )
    counters = _dict(counters)
    if not counters:
        return [*errors, required(f"{field}.counters")]
    if len(counters) > MAX_COUNTERS:
        return [*errors, too_many(f"{field}.counters", len(counters), MAX_COUNTERS)]
    for key, counter in counters.items():
        errors += label_errors(key, f"{field}.counters")
        if "value" not in _dict(counter):
            errors.append(required(_key_path(f"{field}.counters", key) + ".value"))
    return errors


def _device_nodes(device: dict, field: str, per_device: bool) -> list[FieldError]:
    present = [k for k in ("nodeName", "nodeSelector", "allNodes") if device.get(k) is not None]
    if not per_device:
        if present:
            return [
                invalid(
                    field,
                    None,
                    "`nodeName`, `nodeSelector` and `allNodes` can only be set if "
                    "`perDeviceNodeSelection` is set to true in the ResourceSlice spec",
                )
            ]
        return []
    errors, chosen = [], []
    if device.get("nodeName") is not None:
        if device["nodeName"]:
            chosen.append("`nodeName`")
            errors += subdomain_errors(device["nodeName"], f"{field}.nodeName")
        else:
            errors.append(invalid(f"{field}.nodeName", "", "must not be empty"))
    if device.get("nodeSelector") is not None:
        chosen.append("`nodeSelector`")
    if device.get("allNodes") is not None:
        if device["allNodes"] is True:
            chosen.append("`allNodes`")
        else:
            errors.append(
                invalid(
                    f"{field}.allNodes", device["allNodes"], "must be either unset or set to true"
                )
            )
    rule = (
        "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when "
        "`perDeviceNodeSelection` is set to true in the ResourceSlice spec"
    )
    if not chosen:
        errors.append(required(field, rule))
    elif len(chosen) > 1:
        errors.append(invalid(field, "{" + ", ".join(chosen) + "}", rule))
    return errors


def _binding(holder: dict, field: str) -> list[FieldError]:
    conditions = _list(holder.get("bindingConditions"))
    failures = _list(holder.get("bindingFailureConditions"))
    errors = []
    for name, items in (("bindingConditions", conditions), ("bindingFailureConditions", failures)):
        if len(items) > MAX_BINDING_CONDITIONS:
            errors.append(too_many(f"{field}.{name}", len(items), MAX_BINDING_CONDITIONS))
        else:
            for index, item in enumerate(items):
                errors += _label_name_errors(item, f"{field}.{name}[{index}]")
        errors += _duplicates(items, f"{field}.{name}")
    for index, item in enumerate(failures):
        if item in conditions:
            errors.append(
                invalid(
                    f"{field}.bindingFailureConditions[{index}]",
                    item,
                    "bindingFailureConditions must not overlap with bindingConditions",
                )
            )
    if failures and not conditions:
        errors.append(
            invalid(
                f"{field}.bindingConditions",
                conditions,
                "bindingConditions are required to use bindingFailureConditions",
            )
        )
    if conditions and not failures:
        errors.append(
            invalid(
                f"{field}.bindingFailureConditions",
                failures,
                "bindingFailureConditions are required to use bindingConditions",
            )
        )
    return errors


# ---------------------------------------------------------------------------- claims


def _default_claim_spec(spec: dict) -> None:
    """The v1 defaults of the requests: allocationMode ExactCount, count 1."""
    for request in _list(_dict(spec.get("devices")).get("requests")):
        request = _dict(request)
        for exact in [request.get("exactly"), *_list(request.get("firstAvailable"))]:
            if not isinstance(exact, dict):
                continue
            exact.setdefault("allocationMode", "ExactCount")
            if exact["allocationMode"] == "ExactCount":
                exact.setdefault("count", 1)


def request_names(spec: dict) -> dict[str, set[str] | None]:
    """Request name -> its subrequest names (None for an ``exactly`` request)."""
    out: dict[str, set[str] | None] = {}
    for request in _list(_dict(spec.get("devices")).get("requests")):
        request = _dict(request)
        subs = _list(request.get("firstAvailable"))
        out[request.get("name", "")] = {_dict(s).get("name", "") for s in subs} if subs else None
    return out


def _request_ref(name, names: dict, field: str) -> list[FieldError]:
    message = (
        "must be the name of a request in the claim or the name of a request and a "
        "subrequest separated by '/'"
    )
    parts = name.split("/") if isinstance(name, str) else [""]
    if len(parts) > 2:
        return [invalid(field, name, message)]
    errors = [e for part in parts for e in label_errors(part, field)]
    top = names.get(parts[0], "missing") if parts[0] in names else "missing"
    if top == "missing" or (len(parts) == 2 and (top is None or parts[1] not in top)):
        errors.append(invalid(field, name, message))
    return errors


def _claim_spec(spec: dict, field: str) -> list[FieldError]:
    devices = _dict(spec.get("devices"))
    where = f"{field}.devices"
    names = request_names(spec)
    errors = []
    requests = _list(devices.get("requests"))
    if len(requests) > MAX_REQUESTS:
        errors.append(too_many(f"{where}.requests", len(requests), MAX_REQUESTS))
    else:
        for index, request in enumerate(requests):
            errors += _request(_dict(request), f"{where}.requests[{index}]")
        errors += _duplicates([_dict(r).get("name") for r in requests], f"{where}.requests")
    constraints = _list(devices.get("constraints"))
    if len(constraints) > MAX_CONSTRAINTS:
        errors.append(too_many(f"{where}.constraints", len(constraints), MAX_CONSTRAINTS))
    else:
        for index, constraint in enumerate(constraints):
            constraint, path = _dict(constraint), f"{where}.constraints[{index}]"
            for j, name in enumerate(_list(constraint.get("requests"))):
                errors += _request_ref(name, names, f"{path}.requests[{j}]")
            attribute = constraint.get("matchAttribute") or constraint.get("distinctAttribute")
            key = "matchAttribute" if constraint.get("matchAttribute") else "distinctAttribute"
            if not attribute:
                errors.append(
                    required(
                        path,
                        'exactly one of "matchAttribute" or "distinctAttribute" is required, '
                        "but multiple fields are set",
                    )
                )
            else:
                errors += qualified_name_errors(attribute, f"{path}.{key}")
                if "/" not in attribute:
                    errors.append(
                        invalid(
                            f"{path}.{key}",
                            attribute,
                            "a fully qualified name must be a domain and a name separated by "
                            "a slash",
                        )
                    )
    config = _list(devices.get("config"))
    if len(config) > MAX_CONFIG:
        errors.append(too_many(f"{where}.config", len(config), MAX_CONFIG))
    else:
        for index, entry in enumerate(config):
            entry, path = _dict(entry), f"{where}.config[{index}]"
            for j, name in enumerate(_list(entry.get("requests"))):
                errors += _request_ref(name, names, f"{path}.requests[{j}]")
            errors += _opaque(entry, path)
    return errors


def _request(request: dict, field: str) -> list[FieldError]:
    errors = label_errors(request.get("name"), f"{field}.name")
    exactly, first = request.get("exactly"), _list(request.get("firstAvailable"))
    if exactly is None and not first:
        return [
            *errors,
            required(field, "exactly one of `exactly` or `firstAvailable` is required"),
        ]
    if exactly is not None and first:
        return [
            *errors,
            invalid(
                field,
                None,
                "exactly one of `exactly` or `firstAvailable` is required, but multiple fields "
                "are set",
            ),
        ]
    if exactly is not None:
        return errors + _exact(_dict(exactly), f"{field}.exactly")
    if len(first) > MAX_FIRST_AVAILABLE:
        return [*errors, too_many(f"{field}.firstAvailable", len(first), MAX_FIRST_AVAILABLE)]
    for index, sub in enumerate(first):
        sub, path = _dict(sub), f"{field}.firstAvailable[{index}]"
        errors += label_errors(sub.get("name"), f"{path}.name")
        errors += _exact(sub, path)
    return errors + _duplicates([_dict(s).get("name") for s in first], f"{field}.firstAvailable")


def _exact(exact: dict, field: str) -> list[FieldError]:
    errors = []
    class_name = exact.get("deviceClassName")
    if not class_name:
        errors.append(required(f"{field}.deviceClassName"))
    else:
        errors += subdomain_errors(class_name, f"{field}.deviceClassName")
    errors += _selectors(_list(exact.get("selectors")), f"{field}.selectors")
    mode, count = exact.get("allocationMode"), exact.get("count", 0)
    if mode == "All":
        if count:
            errors.append(
                invalid(
                    f"{field}.count", count, "must not be specified when allocationMode is 'All'"
                )
            )
    elif mode == "ExactCount":
        if not isinstance(count, int) or count <= 0:
            errors.append(invalid(f"{field}.count", count, "must be greater than zero"))
    else:
        errors.append(not_supported(f"{field}.allocationMode", mode, ["All", "ExactCount"]))
    for key in _dict(_dict(exact.get("capacity")).get("requests")):
        errors += qualified_name_errors(key, f"{field}.capacity.requests")
    return errors


def _selectors(selectors: list, field: str) -> list[FieldError]:
    if len(selectors) > MAX_SELECTORS:
        return [too_many(field, len(selectors), MAX_SELECTORS)]
    errors = []
    for index, selector in enumerate(selectors):
        cel = _dict(selector).get("cel")
        if not isinstance(cel, dict):
            errors.append(required(f"{field}[{index}].cel"))
        elif len(cel.get("expression") or "") > MAX_CEL:
            errors.append(too_long(f"{field}[{index}].cel.expression", MAX_CEL))
        elif not cel.get("expression"):
            errors.append(required(f"{field}[{index}].cel.expression", "expression is required"))
    return errors


def _opaque(entry: dict, field: str) -> list[FieldError]:
    opaque = entry.get("opaque")
    if not isinstance(opaque, dict):
        return [required(f"{field}.opaque")]
    errors = driver_name_errors(opaque.get("driver"), f"{field}.opaque.driver")
    return errors + _raw_object(opaque.get("parameters"), f"{field}.opaque.parameters", MAX_OPAQUE)


def _raw_object(value, field: str, limit: int) -> list[FieldError]:
    if value is None:
        return [required(field)]
    if len(json.dumps(value, separators=(",", ":"))) > limit:
        return [too_long(field, limit)]
    if not isinstance(value, dict):
        return [invalid(field, "<value omitted>", "must be a valid JSON object")]
    return []


def validate_claim_status(claim: dict, old_status: dict) -> list[FieldError]:
    """A write to ``status`` (ValidateResourceClaimStatusUpdate)."""
    status = _dict(claim.get("status"))
    names = request_names(_dict(claim.get("spec")))
    errors = []
    reserved = _list(status.get("reservedFor"))
    if len(reserved) > MAX_RESERVED_FOR:
        errors.append(too_many("status.reservedFor", len(reserved), MAX_RESERVED_FOR))
    else:
        for index, ref in enumerate(reserved):
            for key in ("resource", "name", "uid"):
                if not _dict(ref).get(key):
                    errors.append(required(f"status.reservedFor[{index}].{key}"))
        errors += _duplicates([_dict(r).get("uid") for r in reserved], "status.reservedFor")
    allocation = status.get("allocation")
    allocated = _allocated_ids(allocation)
    devices = _list(status.get("devices"))
    for index, device in enumerate(devices):
        errors += _device_status(_dict(device), f"status.devices[{index}]", allocated)
    errors += _duplicates(
        [[_dict(d).get(k) for k in ("driver", "pool", "device", "shareID")] for d in devices],
        "status.devices",
    )
    if reserved and allocation is None:
        errors.append(
            forbidden("status.reservedFor", "may not be specified when `allocated` is not set")
        )
    old_allocation = old_status.get("allocation")
    if old_allocation is not None and allocation is not None:
        if allocation != old_allocation:
            errors.append(invalid("status.allocation", allocation, IMMUTABLE))
    elif allocation is not None:
        errors += _allocation(_dict(allocation), names)
    return errors


def _allocated_ids(allocation) -> set[tuple]:
    results = _list(_dict(_dict(allocation).get("devices")).get("results"))
    return {
        tuple(_dict(r).get(k) for k in ("driver", "pool", "device", "shareID")) for r in results
    }


def _allocation(allocation: dict, names: dict) -> list[FieldError]:
    field = "status.allocation.devices"
    devices = _dict(allocation.get("devices"))
    results, config = _list(devices.get("results")), _list(devices.get("config"))
    errors = []
    if len(results) > MAX_REQUESTS:
        errors.append(too_many(f"{field}.results", len(results), MAX_REQUESTS))
    else:
        for index, result in enumerate(results):
            result, path = _dict(result), f"{field}.results[{index}]"
            errors += _request_ref(result.get("request"), names, f"{path}.request")
            errors += driver_name_errors(result.get("driver"), f"{path}.driver")
            errors += pool_name_errors(result.get("pool"), f"{path}.pool")
            errors += label_errors(result.get("device"), f"{path}.device")
            errors += _binding(result, path)
            if result.get("shareID") is not None:
                errors += uid_errors(result["shareID"], f"{path}.shareID")
            for key in _dict(result.get("consumedCapacity")):
                errors += qualified_name_errors(key, f"{path}.consumedCapacity")
    if len(config) > 2 * MAX_CONFIG:
        errors.append(too_many(f"{field}.config", len(config), 2 * MAX_CONFIG))
    else:
        for index, entry in enumerate(config):
            entry, path = _dict(entry), f"{field}.config[{index}]"
            source = entry.get("source")
            if not source:
                errors.append(required(f"{path}.source"))
            elif source not in ("FromClaim", "FromClass"):
                errors.append(not_supported(f"{path}.source", source, ["FromClaim", "FromClass"]))
            for j, name in enumerate(_list(entry.get("requests"))):
                errors += _request_ref(name, names, f"{path}.requests[{j}]")
            errors += _opaque(entry, path)
    return errors


def uid_errors(value, field: str) -> list[FieldError]:
    """A shareID: a UUID in RFC 4122 normalized form (36 lowercase characters)."""
    try:
        uuid.UUID(value)
    except (ValueError, TypeError, AttributeError):
        return [invalid(field, value, "error validating uid: invalid UUID format")]
    if len(value) != 36 or value != value.lower():
        return [
            invalid(
                field,
                value,
                "uid must be in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` "
                "with lowercase hexadecimal characters",
            )
        ]
    return []


def _device_status(device: dict, field: str, allocated: set[tuple]) -> list[FieldError]:
    errors = driver_name_errors(device.get("driver"), f"{field}.driver")
    errors += pool_name_errors(device.get("pool"), f"{field}.pool")
    errors += label_errors(device.get("device"), f"{field}.device")
    if device.get("shareID") is not None:
        errors += uid_errors(device["shareID"], f"{field}.shareID")
    key = tuple(device.get(k) for k in ("driver", "pool", "device", "shareID"))
    if key not in allocated:
        shown = "/".join(str(k) for k in key[:3]) + (f"/{key[3]}" if key[3] else "")
        errors.append(invalid(field, shown, "must be an allocated device in the claim"))
    conditions = _list(device.get("conditions"))
    if len(conditions) > MAX_CONDITIONS:
        errors.append(too_many(f"{field}.conditions", len(conditions), MAX_CONDITIONS))
    if device.get("data") is not None:
        errors += _raw_object(device["data"], f"{field}.data", MAX_DATA)
    return errors


# ---------------------------------------------------------------------------- classes


def _class_spec(spec: dict, field: str) -> list[FieldError]:
    errors = _selectors(_list(spec.get("selectors")), f"{field}.selectors")
    config = _list(spec.get("config"))
    if len(config) > MAX_CONFIG:
        errors.append(too_many(f"{field}.config", len(config), MAX_CONFIG))
    else:
        for index, entry in enumerate(config):
            errors += _opaque(_dict(entry), f"{field}.config[{index}]")
    name = spec.get("extendedResourceName")
    if name is not None and not is_extended_resource_name(name):
        errors.append(
            invalid(f"{field}.extendedResourceName", name, "must be a valid extended resource name")
        )
    return errors
