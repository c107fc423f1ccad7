"""nodemgr.extender.wire: the v1 extender JSON types, field by field.

Pins the key names of k8s.io/kube-scheduler/extender/v1/types.go (Go field names, no
json tags): ExtenderArgs (Pod, Nodes, NodeNames), ExtenderFilterResult (Nodes,
NodeNames, FailedNodes, FailedAndUnresolvableNodes, Error; all written, as Go's
encoder does), HostPriority (Host, Score), ExtenderBindingArgs (PodName, PodNamespace,
PodUID, Node) and ExtenderBindingResult (Error); keys matched case-insensitively and
null taken as unset, as Go's decoder does; input that is not the type raises WireError
naming the field; no request may hold more than the largest real one (5,000 nodes, as
names or as full Node objects), counted before it is parsed where it can be.
"""

from __future__ import annotations

import json

import pytest

from nodemgr.extender import wire
from tests.unit.extender.support import MEMORY, annotation, node, pod

POD = pod("job", ("main", {MEMORY: 4}))


def args(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_extender_args_with_node_names_or_nodes():
    parsed = wire.parse_extender_args(args(Pod=POD, Nodes=None, NodeNames=["a", "b"]))
    assert parsed.node_names == ["a", "b"] and parsed.nodes is None
    assert parsed.candidate_names() == ["a", "b"]
    assert parsed.pod_label == "default/job"
    nodes = {"metadata": {}, "items": [node("a"), node("b")]}
    parsed = wire.parse_extender_args(args(Pod=POD, Nodes=nodes, NodeNames=None))
    assert parsed.candidate_names() == ["a", "b"] and parsed.node_names is None
    empty = wire.parse_extender_args(args(Pod=POD, Nodes={"metadata": {}, "items": None}))
    assert empty.candidate_names() == []  # Go marshals a nil slice as null


def test_keys_match_case_insensitively_as_go_decodes():
    parsed = wire.parse_extender_args(args(pod=POD, nodenames=["a"], Extra=1))
    assert parsed.node_names == ["a"]
    binding = wire.parse_binding_args(
        args(podName="p", podnamespace="ns", PODUID="u", node="n", other=True)
    )
    assert binding == wire.ExtenderBindingArgs("p", "ns", "u", "n")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "ExtenderArgs: the body is not JSON"),
        (b"[]", "ExtenderArgs: a JSON object expected, got a list"),
        (args(NodeNames=["a"]), "ExtenderArgs.Pod: required"),
        (
            args(Pod="job", NodeNames=["a"]),
            "ExtenderArgs.Pod: a v1.Pod object expected, got a string",
        ),
        (args(Pod={"spec": {}}, NodeNames=["a"]), "ExtenderArgs.Pod.metadata.name: required"),
        (args(Pod={"metadata": {"name": "p"}}, NodeNames=["a"]), "ExtenderArgs.Pod.spec: required"),
        (
            args(Pod=POD, NodeNames=["a", 3]),
            "ExtenderArgs.NodeNames: a list of node names expected",
        ),
        (args(Pod=POD, NodeNames="a"), "ExtenderArgs.NodeNames: a list of strings expected"),
        (args(Pod=POD, Nodes=[]), "ExtenderArgs.Nodes: a v1.NodeList object expected, got a list"),
        (args(Pod=POD, Nodes={"items": {}}), "ExtenderArgs.Nodes.items: a list expected"),
        (
            args(Pod=POD, Nodes={"items": [{"metadata": {}}]}),
            "ExtenderArgs.Nodes.items[0].metadata.name",
        ),
        (args(Pod=POD), "ExtenderArgs: neither Nodes nor NodeNames is set"),
    ],
)
def test_bad_extender_args_name_the_field(body, message):
    with pytest.raises(wire.WireError, match=message.replace("[", r"\[").replace("]", r"\]")):
        wire.parse_extender_args(body)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"PodNamespace": "ns", "Node": "n"}, "ExtenderBindingArgs.PodName: required"),
        ({"PodName": "p", "PodNamespace": "ns"}, "ExtenderBindingArgs.Node: required"),
        (
            {"PodName": "p", "Node": "n", "PodUID": 7},
            "ExtenderBindingArgs.PodUID: a string expected, got 7",
        ),
    ],
)
def test_bad_binding_args_name_the_field(fields, message):
    with pytest.raises(wire.WireError, match=message):
        wire.parse_binding_args(args(**fields))


def test_results_carry_every_go_field():
    result = wire.ExtenderFilterResult(node_names=["a"], failed_nodes={"b": "why"})
    assert result.to_json() == {
        "Nodes": None,
        "NodeNames": ["a"],
        "FailedNodes": {"b": "why"},
        "FailedAndUnresolvableNodes": {},
        "Error": "",
    }
    with_nodes = wire.ExtenderFilterResult(nodes=[node("a")]).to_json()
    assert with_nodes["Nodes"] == {"metadata": {}, "items": [node("a")]}
    assert with_nodes["NodeNames"] is None
    assert wire.host_priority_list([wire.HostPriority("a", 7)]) == [{"Host": "a", "Score": 7}]
    assert wire.binding_result() == {"Error": ""}
    assert (wire.MIN_PRIORITY, wire.MAX_PRIORITY) == (0, 10)


def test_no_request_holds_more_than_the_largest_real_one():
    """Sized from 5,000 nodes: more node names, more Node objects, a body that would parse
    into more values than 5,000 full Nodes (counted before parsing), a body nested too
    deep: each refused naming why; 5,000 names and 5,000 full Nodes pass."""
    names = [f"node-{i}" for i in range(5000)]
    assert len(wire.parse_extender_args(args(Pod=POD, NodeNames=names)).node_names) == 5000
    with pytest.raises(wire.WireError, match=r"NodeNames: 5001 nodes, more than the 5000"):
        wire.parse_extender_args(args(Pod=POD, NodeNames=[*names, "one-more"]))
    nodes = {"items": [realistic_node(i) for i in range(5000)]}
    body = args(Pod=POD, Nodes=nodes)
    assert len(body) > 64 * 1024 * 1024  # ~14 KiB per node, as kubelet reports it
    assert len(wire.parse_extender_args(body).nodes) == 5000
    small = wire.Limits(max_nodes=10)
    with pytest.raises(wire.WireError, match=r"Nodes.items: 11 nodes, more than the 10"):
        wire.parse_extender_args(
            args(Pod=POD, Nodes={"items": [node(str(i)) for i in range(11)]}), small
        )
    ones = b'{"Pod": {}, "NodeNames": [' + b"1," * 5_100_000 + b"1]}"
    with pytest.raises(
        wire.WireError, match="holds up to 5100004 JSON values, more than the 5020000"
    ):
        wire.parse_extender_args(ones)
    with pytest.raises(wire.WireError, match="the body is over"):
        wire.parse_extender_args(b" " * (small.max_body_bytes + 1), small)
    with pytest.raises(wire.WireError, match="nested too deep"):
        wire.parse_extender_args(b'{"Pod": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(wire.WireError, match="PodName: over 253 characters"):
        wire.parse_binding_args(args(PodName="x" * 254, Node="n"))


def realistic_node(i):
    """A Node as kube-scheduler's informer holds it: labels, annotations (the gpus one of 8
    cards), managed fields, conditions, capacity, node info and kubelet's 50 images."""
    text = annotation(*[(4, 30)] * 8)
    obj = node(f"gpu-node-{i}", text)
    obj["metadata"]["labels"] = {f"label-{k}.example.com/key": f"value-{k}" for k in range(18)}
    obj["metadata"]["managedFields"] = [
        {"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
         "fieldsV1": {"f:status": {f"f:{t}": {".": {}, "f:status": {}, "f:reason": {}}
                                    for t in ("MemoryPressure", "DiskPressure", "Ready")}}}
    ]  # fmt: skip
    obj["status"] = {
        "capacity": {f"resource-{k}": "8" for k in range(10)},
        "allocatable": {f"resource-{k}": "8" for k in range(10)},
        "conditions": [
            {
                "type": t,
                "status": "False",
                "reason": f"Kubelet{t}",
                "message": "m" * 40,
                "lastHeartbeatTime": "2026-01-01T00:00:00Z",
            }
            for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
        ],  # fmt: skip
        "nodeInfo": {f"field-{k}": "x" * 36 for k in range(10)},
        "images": [
            {
                "names": [
                    f"registry.example.com/team-{k}/image@sha256:" + "ab" * 32,
                    f"registry.example.com/team-{k}/image:v1.{k}",
                ],
                "sizeBytes": 123456789,
            }
            for k in range(50)
        ],  # fmt: skip
    }
    return obj
