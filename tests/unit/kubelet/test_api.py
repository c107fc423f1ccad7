"""The generated kubelet API code holds to kubelet's wire format (nodemgr/kubelet/api).

Kubelet and the plugin only agree when every package, message, field name, field
number, type, cardinality and proto3 ``optional`` is exactly kubelet's: a wrong
number decodes as an unknown field and is silently dropped. These tests read the
descriptors of the generated modules and pin them to the facts in docs/dra.md and
docs/kubelet-api.md, check the full gRPC method paths the generated stubs dial, and
encode a few messages byte by byte.
"""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor as F

from nodemgr.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from nodemgr.kubelet.api import pluginregistration_v1_pb2 as reg_pb2
from nodemgr.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from nodemgr.kubelet.api import podresources_v1_pb2 as pr_pb2
from nodemgr.kubelet.api import podresources_v1_pb2_grpc as pr_grpc

S, B, M, I64 = F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_MESSAGE, F.TYPE_INT64
ONE, MANY, OPT = "singular", "repeated", "optional"  # OPT: proto3 `optional` (presence)


def shape(message) -> dict[str, tuple]:
    """name -> (number, type, cardinality[, message type's full name]) of a message."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        card = MANY if field.is_repeated else OPT if _explicit(field) else ONE
        entry = (field.number, field.type, card)
        if field.type == M:
            entry += (field.message_type.full_name,)
        out[field.name] = entry
    return out


def _explicit(field) -> bool:
    """proto3 `optional`: a synthetic oneof named _<field> gives the field presence."""
    oneof = field.containing_oneof
    return oneof is not None and oneof.name == "_" + field.name and field.has_presence


def map_entry(message, field_name: str) -> tuple[int, int, str | None]:
    """(key type, value type, value message) of a map<,> field."""
    entry = message.DESCRIPTOR.fields_by_name[field_name].message_type
    assert entry.GetOptions().map_entry, f"{field_name} is not a map"
    value = entry.fields_by_name["value"]
    return (
        entry.fields_by_name["key"].type,
        value.type,
        value.message_type.full_name if value.message_type else None,
    )


class _RecordingChannel:
    """Stands in for a grpc.Channel: records the method paths a stub is built with."""

    def __init__(self):
        self.paths = []

    def _record(self, path, *args, **kwargs):
        self.paths.append(path)
        return lambda *a, **k: None

    unary_unary = unary_stream = stream_unary = stream_stream = _record


def stub_paths(stub_class) -> list[str]:
    channel = _RecordingChannel()
    stub_class(channel)
    return sorted(channel.paths)


# ---------------------------------------------------------------- registration


def test_plugin_registration_package_messages_and_fields():
    """pluginregistration v1: the package is ``pluginregistration`` (not v1); PluginInfo
    {type=1, name=2, endpoint=3, repeated supported_versions=4}, RegistrationStatus
    {plugin_registered=1 bool, error=2}, InfoRequest and RegistrationStatusResponse empty."""
    assert reg_pb2.DESCRIPTOR.package == "pluginregistration"
    assert shape(reg_pb2.PluginInfo) == {
        "type": (1, S, ONE),
        "name": (2, S, ONE),
        "endpoint": (3, S, ONE),
        "supported_versions": (4, S, MANY),
    }
    assert shape(reg_pb2.RegistrationStatus) == {
        "plugin_registered": (1, B, ONE),
        "error": (2, S, ONE),
    }
    assert shape(reg_pb2.InfoRequest) == {}
    assert shape(reg_pb2.RegistrationStatusResponse) == {}
    assert reg_pb2.PluginInfo.DESCRIPTOR.full_name == "pluginregistration.PluginInfo"


def test_plugin_registration_method_paths_and_types():
    """The Registration service's full method paths, as the stub dials them and the
    servicer serves them, with their request and response messages."""
    service = reg_pb2.DESCRIPTOR.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    methods = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in service.methods}
    assert methods == {
        "GetInfo": ("pluginregistration.InfoRequest", "pluginregistration.PluginInfo"),
        "NotifyRegistrationStatus": (
            "pluginregistration.RegistrationStatus",
            "pluginregistration.RegistrationStatusResponse",
        ),
    }
    assert stub_paths(reg_grpc.RegistrationStub) == [
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    ]


def test_plugin_info_bytes_on_the_wire():
    """A PluginInfo encodes with kubelet's tags: 0x0a type, 0x12 name, 0x1a endpoint,
    0x22 per supported version."""
    info = reg_pb2.PluginInfo(
        type="DRAPlugin", name="d.io", endpoint="/e", supported_versions=["v1.DRAPlugin"]
    )
    assert info.SerializeToString() == (
        b"\x0a\x09DRAPlugin\x12\x04d.io\x1a\x02/e\x22\x0cv1.DRAPlugin"
    )
    status = reg_pb2.RegistrationStatus(plugin_registered=True, error="x")
    assert status.SerializeToString() == b"\x08\x01\x12\x01x"


# ---------------------------------------------------------------- DRA node API

DRA_V1 = "k8s.io.kubelet.pkg.apis.dra.v1"
DRA_V1BETA1 = "k8s.io.kubelet.pkg.apis.dra.v1beta1"


@pytest.mark.parametrize(
    ("module", "package", "share_id"),
    [(dra_v1_pb2, DRA_V1, True), (dra_v1beta1_pb2, DRA_V1BETA1, False)],
    ids=["v1", "v1beta1"],
)
def test_dra_messages_and_fields(module, package, share_id):
    """DRA v1 and v1beta1: the package, every message's fields (Claim {namespace=1,
    uid=2, name=3}, Device {request_names=1, pool_name=2, device_name=3,
    cdi_device_ids=4} plus, in v1 only, proto3-optional share_id=5), the
    claim-UID-keyed maps of both responses."""
    assert module.DESCRIPTOR.package == package
    claim = f"{package}.Claim"
    assert shape(module.NodePrepareResourcesRequest) == {"claims": (1, M, MANY, claim)}
    assert shape(module.NodeUnprepareResourcesRequest) == {"claims": (1, M, MANY, claim)}
    assert shape(module.Claim) == {
        "namespace": (1, S, ONE),
        "uid": (2, S, ONE),
        "name": (3, S, ONE),
    }
    device = {
        "request_names": (1, S, MANY),
        "pool_name": (2, S, ONE),
        "device_name": (3, S, ONE),
        "cdi_device_ids": (4, S, MANY),
    }
    if share_id:
        device["share_id"] = (5, S, OPT)
    assert shape(module.Device) == device
    assert shape(module.NodePrepareResourceResponse) == {
        "devices": (1, M, MANY, f"{package}.Device"),
        "error": (2, S, ONE),
    }
    assert shape(module.NodeUnprepareResourceResponse) == {"error": (1, S, ONE)}
    assert map_entry(module.NodePrepareResourcesResponse, "claims") == (
        S,
        M,
        f"{package}.NodePrepareResourceResponse",
    )
    assert map_entry(module.NodeUnprepareResourcesResponse, "claims") == (
        S,
        M,
        f"{package}.NodeUnprepareResourceResponse",
    )
    for response in (module.NodePrepareResourcesResponse, module.NodeUnprepareResourcesResponse):
        assert response.DESCRIPTOR.fields_by_name["claims"].number == 1


@pytest.mark.parametrize(
    ("module", "grpc_module", "package"),
    [(dra_v1_pb2, dra_v1_pb2_grpc, DRA_V1), (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc, DRA_V1BETA1)],
    ids=["v1", "v1beta1"],
)
def test_dra_method_paths(module, grpc_module, package):
    """The DRAPlugin service's full method paths, e.g.
    ``/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources``."""
    service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert service.full_name == f"{package}.DRAPlugin"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
        "NodeUnprepareResources": (
            "NodeUnprepareResourcesRequest",
            "NodeUnprepareResourcesResponse",
        ),
    }
    assert stub_paths(grpc_module.DRAPluginStub) == [
        f"/{package}.DRAPlugin/NodePrepareResources",
        f"/{package}.DRAPlugin/NodeUnprepareResources",
    ]


def test_dra_v1_share_id_has_presence_on_the_wire():
    """share_id is proto3 ``optional``: an empty share ID set explicitly is sent (tag
    0x2a, length 0) and read back as present; an unset one is not sent at all, so a
    v1beta1 reader and a v1 reader of a device without share see the same bytes."""
    with_empty = dra_v1_pb2.Device(device_name="gpu-0", share_id="")
    assert with_empty.SerializeToString() == b"\x1a\x05gpu-0\x2a\x00"
    assert dra_v1_pb2.Device.FromString(with_empty.SerializeToString()).HasField("share_id")
    unset = dra_v1_pb2.Device(device_name="gpu-0")
    assert not unset.HasField("share_id")
    assert (
        unset.SerializeToString() == dra_v1beta1_pb2.Device(device_name="gpu-0").SerializeToString()
    )


def test_dra_prepare_response_bytes_on_the_wire():
    """A NodePrepareResourcesResponse encodes its map as repeated entries (field 1) of
    key=1 (claim UID) and value=2 (the per-claim response)."""
    response = dra_v1_pb2.NodePrepareResourcesResponse()
    response.claims["u"].error = "e"
    assert response.SerializeToString() == b"\x0a\x08\x0a\x01u\x12\x03\x12\x01e"


# ---------------------------------------------------------------- PodResources v1


def test_podresources_dynamic_resources_fields():
    """PodResources v1 as kubelet 1.35+: ContainerResources.dynamic_resources=5;
    DynamicResource {claim_name=2, claim_namespace=3, claim_resources=4} with field 1
    removed upstream (never reused); ClaimResource {cdi_devices=1, driver_name=2,
    pool_name=3, device_name=4, optional share_id=5}; CDIDevice {name=1}."""
    assert pr_pb2.DESCRIPTOR.package == "v1"
    assert shape(pr_pb2.ContainerResources) == {
        "name": (1, S, ONE),
        "devices": (2, M, MANY, "v1.ContainerDevices"),
        "cpu_ids": (3, I64, MANY),
        "memory": (4, M, MANY, "v1.ContainerMemory"),
        "dynamic_resources": (5, M, MANY, "v1.DynamicResource"),
    }
    assert shape(pr_pb2.DynamicResource) == {
        "claim_name": (2, S, ONE),
        "claim_namespace": (3, S, ONE),
        "claim_resources": (4, M, MANY, "v1.ClaimResource"),
    }
    assert shape(pr_pb2.ClaimResource) == {
        "cdi_devices": (1, M, MANY, "v1.CDIDevice"),
        "driver_name": (2, S, ONE),
        "pool_name": (3, S, ONE),
        "device_name": (4, S, ONE),
        "share_id": (5, S, OPT),
    }
    assert shape(pr_pb2.CDIDevice) == {"name": (1, S, ONE)}


def test_podresources_earlier_fields_and_paths_are_unchanged():
    """What the device plugin side already relies on stays as it was: the PodResources
    and ContainerDevices fields and the three PodResourcesLister method paths."""
    assert shape(pr_pb2.PodResources) == {
        "name": (1, S, ONE),
        "namespace": (2, S, ONE),
        "containers": (3, M, MANY, "v1.ContainerResources"),
    }
    assert shape(pr_pb2.ContainerDevices) == {
        "resource_name": (1, S, ONE),
        "device_ids": (2, S, MANY),
        "topology": (3, M, ONE, "v1.TopologyInfo"),
    }
    assert stub_paths(pr_grpc.PodResourcesListerStub) == [
        "/v1.PodResourcesLister/Get",
        "/v1.PodResourcesLister/GetAllocatableResources",
        "/v1.PodResourcesLister/List",
    ]


def test_podresources_dynamic_resource_bytes_on_the_wire():
    """A container's dynamic resource encodes as kubelet's: ContainerResources field 5,
    DynamicResource fields 2/3/4, ClaimResource fields 1..5, CDIDevice name=1."""
    container = pr_pb2.ContainerResources(
        dynamic_resources=[
            pr_pb2.DynamicResource(
                claim_name="c",
                claim_namespace="n",
                claim_resources=[
                    pr_pb2.ClaimResource(
                        cdi_devices=[pr_pb2.CDIDevice(name="k=x")],
                        driver_name="d",
                        pool_name="p",
                        device_name="g",
                        share_id="s",
                    )
                ],
            )
        ]
    )
    claim_resource = b"\x0a\x05\x0a\x03k=x\x12\x01d\x1a\x01p\x22\x01g\x2a\x01s"
    dynamic = b"\x12\x01c\x1a\x01n\x22" + bytes([len(claim_resource)]) + claim_resource
    assert container.SerializeToString() == b"\x2a" + bytes([len(dynamic)]) + dynamic
