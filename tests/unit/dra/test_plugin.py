"""Pins nodemgr.dra.plugin over real gRPC on unix sockets: GetInfo (type, name, endpoint,
v1 before v1beta1), kubelet's verdict kept, the servicers' translation of both API
versions (share ID only in v1; an empty entry present), kubelet's deadline handed to the
driver, the claim budget, sockets bound again after removal, and removed on stop."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import grpc
import pytest

from nodemgr.config.schema import DraSettings
from nodemgr.dra import plugin as plugin_module
from nodemgr.dra.driver import Prepared, PreparedDevice
from nodemgr.dra.plugin import DraPlugin
from nodemgr.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from nodemgr.kubelet.api import pluginregistration_v1_pb2 as reg
from nodemgr.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc

DEVICE = PreparedDevice(("gpu",), "node-a", "gpu-a", ("gpushare.aliyun.com/gpu=u1-gpu-a-s",), "s")


class FakeDriver:
    def __init__(self):
        self.calls = []

    def prepare(self, claims, deadline=None):
        self.calls.append(("prepare", [c.uid for c in claims], deadline))
        return {"u1": Prepared((DEVICE,)), "u2": Prepared(error="no room"), "u3": Prepared()}

    def unprepare(self, claims):
        self.calls.append(("unprepare", [c.uid for c in claims], None))
        return {c.uid: None for c in claims}


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(plugin_module, "CHECK_PERIOD_SECONDS", 0.05)
    root = tempfile.mkdtemp(prefix="dp", dir="/tmp")
    settings = DraSettings(enabled=True, plugins_registry_dir=f"{root}/registry",
                           plugins_dir=f"{root}/plugins", cdi_dir=f"{root}/cdi")  # fmt: skip
    driver = FakeDriver()
    plugin = DraPlugin(settings, driver)
    plugin.start()
    yield plugin, driver
    plugin.stop()
    plugin.join(5)
    shutil.rmtree(root, ignore_errors=True)


def channel(path):
    return grpc.insecure_channel(f"unix://{path}")


def claims(*uids):
    return [dra_v1_pb2.Claim(namespace="ns", uid=u, name=f"c-{u}") for u in uids]


def test_get_info_names_the_driver_its_socket_and_v1_first(served):
    plugin, _ = served
    stub = reg_grpc.RegistrationStub(channel(plugin.settings.registration_socket))
    info = stub.GetInfo(reg.InfoRequest(), timeout=5)
    assert (info.type, info.name, info.endpoint) == (
        "DRAPlugin", "gpushare.aliyun.com", plugin.settings.service_socket)  # fmt: skip
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=False, error="x"))
    assert plugin.state()["registered"] is False and plugin.state()["registration_error"] == "x"
    for path in (plugin.settings.registration_socket, plugin.settings.service_socket):
        assert os.stat(path).st_mode & 0o777 == 0o600


def test_v1_answers_devices_share_ids_errors_and_empty_entries(served):
    """Every claim the driver answered has an entry (an empty one too); kubelet's
    deadline less the margin reaches the driver."""
    plugin, driver = served
    stub = dra_v1_pb2_grpc.DRAPluginStub(channel(plugin.settings.service_socket))
    started = time.monotonic()
    answer = stub.NodePrepareResources(
        dra_v1_pb2.NodePrepareResourcesRequest(claims=claims("u1", "u2", "u3")), timeout=45
    )
    assert set(answer.claims) == {"u1", "u2", "u3"}
    [device] = answer.claims["u1"].devices
    assert (device.device_name, device.share_id, list(device.cdi_device_ids)) == (
        "gpu-a", "s", ["gpushare.aliyun.com/gpu=u1-gpu-a-s"])  # fmt: skip
    assert answer.claims["u2"].error == "no room" and not answer.claims["u3"].devices
    _, uids, deadline = driver.calls[0]
    assert uids == ["u1", "u2", "u3"] and started + 40 < deadline < started + 44


def test_v1beta1_answers_without_share_ids_and_unprepares(served):
    plugin, driver = served
    stub = dra_v1beta1_pb2_grpc.DRAPluginStub(channel(plugin.settings.service_socket))
    request = dra_v1beta1_pb2.NodePrepareResourcesRequest(
        claims=[dra_v1beta1_pb2.Claim(namespace="ns", uid="u1", name="c")]
    )
    [device] = stub.NodePrepareResources(request, timeout=5).claims["u1"].devices
    assert device.device_name == "gpu-a" and "share_id" not in device.DESCRIPTOR.fields_by_name
    gone = stub.NodeUnprepareResources(
        dra_v1beta1_pb2.NodeUnprepareResourcesRequest(claims=request.claims), timeout=5
    )
    assert list(gone.claims) == ["u1"] and gone.claims["u1"].error == ""


def test_too_many_claims_in_one_call_is_refused(served):
    plugin, driver = served
    stub = dra_v1_pb2_grpc.DRAPluginStub(channel(plugin.settings.service_socket))
    many = claims(*(f"u{i}" for i in range(plugin_module.MAX_CLAIMS + 1)))
    with pytest.raises(grpc.RpcError) as refused:
        stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=many), timeout=5)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert driver.calls == []


def test_a_removed_socket_is_bound_again_and_stop_removes_both(served):
    plugin, _ = served
    registration = plugin.settings.registration_socket
    os.unlink(registration)
    deadline = time.monotonic() + 5
    while not (os.path.exists(registration) and plugin.sockets_present()):
        assert time.monotonic() < deadline, "the registration socket was not bound again"
        time.sleep(0.05)
    stub = reg_grpc.RegistrationStub(channel(registration))
    assert stub.GetInfo(reg.InfoRequest(), timeout=5).name == "gpushare.aliyun.com"
    plugin.stop()
    assert plugin.join(5)
    assert not os.path.exists(registration)
    assert not os.path.exists(plugin.settings.service_socket)
