"""The kube-scheduler extender v1 wire format (k8s.io/kube-scheduler/extender/v1/types.go).

The Go types have no json tags: keys are the Go field names, matched
case-insensitively (an exact match first); ``null`` leaves a field unset; unknown keys
are ignored.

- ``ExtenderArgs`` (POST <urlPrefix>/filter and /prioritize): ``Pod``
  (a v1.Pod), ``Nodes`` (a v1.NodeList, only when ``nodeCacheCapable: false``)
  and ``NodeNames`` (a list of names, only when ``nodeCacheCapable: true``);
- ``ExtenderFilterResult``: ``Nodes`` (the nodes that pass, as received, when
  the scheduler sent Nodes), ``NodeNames`` (when it sent NodeNames),
  ``FailedNodes`` and ``FailedAndUnresolvableNodes`` (node name -> reason; the
  latter: preemption cannot help) and ``Error`` (non-empty: the whole call
  failed, and the scheduler retries the pod);
- ``HostPriorityList``: a list of ``{"Host", "Score"}``, scores 0 to
  ``MAX_PRIORITY`` (10), which kube-scheduler multiplies by the extender's
  weight and by 10;
- ``ExtenderBindingArgs`` (POST <urlPrefix>/bind): ``PodName``,
  ``PodNamespace``, ``PodUID``, ``Node``; ``ExtenderBindingResult``: ``Error``.

Results carry all their keys, as Go writes a struct without omitempty. No ``%`` goes
out (``scheduler_text``): kube-scheduler posts the text as the *format* of the pod's
FailedScheduling event (``10% free`` reads ``10%!f(MISSING)ree``) and unformatted in its
PodScheduled condition (``%%`` would show doubled). Undecodable input raises
``WireError`` naming the field (HTTP 400).

A request costs at most what the largest real one does: 5,000 nodes, as names or as
full Node objects (~17 KiB and ~600 JSON values each with 50 images; ``NODE_BYTES``
and ``NODE_VALUES`` leave room). The HTTP layer refuses a longer body unread;
``decode`` counts the JSON values a body can hold (commas and brackets, a cheap bound)
and refuses more before parsing; node lists are held to ``max_nodes``.

What it must not do: any I/O; decide anything about GPUs (that is logic's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MIN_PRIORITY = 0
MAX_PRIORITY = 10

MAX_NODES = 5000  # the largest cluster Kubernetes supports
NODE_BYTES = 24 * 1024
NODE_VALUES = 1000
POD_BYTES = 1024 * 1024  # the pod and the envelope
POD_VALUES = 20_000


@dataclass(frozen=True)
class Limits:
    max_nodes: int = MAX_NODES

    @property
    def max_body_bytes(self) -> int:
        return self.max_nodes * NODE_BYTES + POD_BYTES

    @property
    def max_values(self) -> int:
        return self.max_nodes * NODE_VALUES + POD_VALUES


class WireError(ValueError):
    """HTTP 400 with this message."""


@dataclass(frozen=True)
class ExtenderArgs:
    pod: Mapping[str, Any]
    nodes: list[Mapping[str, Any]] | None  # Nodes.items, when the scheduler sent Nodes
    node_names: list[str] | None  # NodeNames, when it sent names

    def candidate_names(self) -> list[str]:
        if self.node_names is not None:
            return self.node_names
        return [_node_name(node, i) for i, node in enumerate(self.nodes or [])]

    @property
    def pod_label(self) -> str:
        metadata = self.pod.get("metadata") or {}
        return f"{metadata.get('namespace') or ''}/{metadata.get('name') or ''}"


@dataclass(frozen=True)
class ExtenderBindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


@dataclass
class ExtenderFilterResult:
    """In the form of the request: names for names, nodes for nodes."""

    nodes: list[Mapping[str, Any]] | None = None
    node_names: list[str] | None = None
    failed_nodes: dict[str, str] = field(default_factory=dict)
    failed_and_unresolvable_nodes: dict[str, str] = field(default_factory=dict)
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "Nodes": None if self.nodes is None else {"metadata": {}, "items": self.nodes},
            "NodeNames": self.node_names,
            "FailedNodes": {n: scheduler_text(r) for n, r in self.failed_nodes.items()},
            "FailedAndUnresolvableNodes": {
                n: scheduler_text(r) for n, r in self.failed_and_unresolvable_nodes.items()
            },
            "Error": scheduler_text(self.error),
        }


@dataclass(frozen=True)
class HostPriority:
    host: str
    score: int

    def to_json(self) -> dict[str, Any]:
        return {"Host": self.host, "Score": self.score}


def host_priority_list(priorities: Sequence[HostPriority]) -> list[dict[str, Any]]:
    return [p.to_json() for p in priorities]


def binding_result(error: str = "") -> dict[str, str]:
    return {"Error": scheduler_text(error)}


_PERCENT = re.compile(r" ?%")


def scheduler_text(text: str) -> str:
    """``40%`` becomes ``40 percent`` (see the module)."""
    return _PERCENT.sub(" percent", text) if "%" in text else text


# --- decoding ----------------------------------------------------------------------


def decode(body: bytes, type_name: str, limits: Limits | None = None) -> dict[str, Any]:
    limits = limits or Limits()
    if len(body) > limits.max_body_bytes:
        raise WireError(f"{type_name}: the body is over {limits.max_body_bytes} bytes")
    # Every value but the first follows a comma or opens an array or object (those inside
    # strings only raise the bound): counted at memchr speed.
    values = body.count(b",") + body.count(b"[") + body.count(b"{")
    if values > limits.max_values:
        raise WireError(
            f"{type_name}: the body holds up to {values} JSON values, more than the "
            f"{limits.max_values} of a request for {limits.max_nodes} nodes"
        )
    try:
        value = json.loads(body)
    except RecursionError:
        raise WireError(f"{type_name}: the body is nested too deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"{type_name}: the body is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise WireError(f"{type_name}: a JSON object expected, got {_kind(value)}")
    return value


def parse_extender_args(body: bytes, limits: Limits | None = None) -> ExtenderArgs:
    limits = limits or Limits()
    document = decode(body, "ExtenderArgs", limits)
    fields = _go_fields(document, ("Pod", "Nodes", "NodeNames"))
    pod = fields.get("Pod")
    if pod is None:
        raise WireError("ExtenderArgs.Pod: required (the pod being scheduled)")
    if not isinstance(pod, dict):
        raise WireError(f"ExtenderArgs.Pod: a v1.Pod object expected, got {_kind(pod)}")
    _check_pod(pod)
    nodes = fields.get("Nodes")
    items: list[Mapping[str, Any]] | None = None
    if nodes is not None:
        if not isinstance(nodes, dict):
            raise WireError(
                f"ExtenderArgs.Nodes: a v1.NodeList object expected, got {_kind(nodes)}"
            )
        raw = nodes.get("items")
        if raw is not None and not isinstance(raw, list):
            raise WireError(f"ExtenderArgs.Nodes.items: a list expected, got {_kind(raw)}")
        items = list(raw or [])
        _check_count("ExtenderArgs.Nodes.items", len(items), limits)
        for i, node in enumerate(items):
            _node_name(node, i)
    names = fields.get("NodeNames")
    if names is not None:
        if not isinstance(names, list):
            raise WireError(
                f"ExtenderArgs.NodeNames: a list of strings expected, got {_short(names)}"
            )
        _check_count("ExtenderArgs.NodeNames", len(names), limits)
        if not all(isinstance(n, str) and 0 < len(n) <= 253 for n in names):
            raise WireError(
                "ExtenderArgs.NodeNames: a list of node names expected (strings of 1 to 253 "
                "characters)"
            )
    if items is None and names is None:
        raise WireError(
            "ExtenderArgs: neither Nodes nor NodeNames is set (nodeCacheCapable false sends "
            "Nodes, true sends NodeNames)"
        )
    return ExtenderArgs(pod=pod, nodes=items, node_names=names)


def parse_binding_args(body: bytes, limits: Limits | None = None) -> ExtenderBindingArgs:
    document = decode(body, "ExtenderBindingArgs", limits)
    fields = _go_fields(document, ("PodName", "PodNamespace", "PodUID", "Node"))
    values = {}
    for name in ("PodName", "PodNamespace", "PodUID", "Node"):
        value = fields.get(name)
        if value is None:
            value = ""
        if not isinstance(value, str):
            raise WireError(f"ExtenderBindingArgs.{name}: a string expected, got {_short(value)}")
        values[name] = value
    for name in ("PodName", "Node"):
        if not values[name]:
            raise WireError(f"ExtenderBindingArgs.{name}: required")
    for name, value in values.items():
        if len(value) > 253:
            raise WireError(f"ExtenderBindingArgs.{name}: over 253 characters")
    return ExtenderBindingArgs(
        values["PodName"], values["PodNamespace"], values["PodUID"], values["Node"]
    )


def _check_count(field_name: str, count: int, limits: Limits) -> None:
    if count > limits.max_nodes:
        raise WireError(
            f"{field_name}: {count} nodes, more than the {limits.max_nodes} this extender "
            "takes (--max-nodes)"
        )


def _go_fields(document: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """As Go's decoder fills them: exact key, else a case-insensitive one."""
    fields: dict[str, Any] = {}
    lowered = {key.lower(): key for key in document}
    for name in names:
        key = name if name in document else lowered.get(name.lower())
        if key is not None and document[key] is not None:
            fields[name] = document[key]
    return fields


def _check_pod(pod: Mapping[str, Any]) -> None:
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
        raise WireError("ExtenderArgs.Pod.metadata.name: required (a string)")
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise WireError("ExtenderArgs.Pod.spec: required (an object)")
    for part in ("containers", "initContainers"):
        containers = spec.get(part)
        if containers is None:
            continue
        if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
            raise WireError(f"ExtenderArgs.Pod.spec.{part}: a list of containers expected")


def _node_name(node: Any, index: int) -> str:
    name = (node.get("metadata") or {}).get("name") if isinstance(node, dict) else None
    if not isinstance(name, str) or not name:
        raise WireError(f"ExtenderArgs.Nodes.items[{index}].metadata.name: required (a string)")
    return name


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number"
    )


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
