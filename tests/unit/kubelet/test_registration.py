"""Pins nodemgr.kubelet.registration against the test kubelet (standins/kubelet_sim.py)
and a hung stand-in: a resource registers with version v1beta1, its endpoint and options,
and kubelet then reads its device list; a refusal or a missing kubelet socket raises
KubeletUnavailable naming the resource, the socket and gRPC's reason; a kubelet that
never answers does not delay a stop (register returns False, the call is cancelled)."""

import os
import shutil
import tempfile
import threading
import time
from concurrent import futures

import grpc
import pytest

from nodemgr.allocation.resources import DeviceInfo
from nodemgr.common.changes import ChangeCounter
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from nodemgr.kubelet.registration import API_VERSION, KubeletUnavailable, register
from nodemgr.kubelet.servicer import OPTIONS, PluginServer
from standins.kubelet_sim import TestKubelet

MEM = ResourceKind.MEMORY
MEM_NAME = "aliyun.com/gpu-mem"


class Resources:
    """The least a PluginServer needs to serve a device list."""

    resource_names = {MEM: MEM_NAME}

    def __init__(self):
        self.device_changes = ChangeCounter()

    def devices(self, kind):
        return [DeviceInfo("GPU-a-_-0", True, None), DeviceInfo("GPU-a-_-1", True, None)]


@pytest.fixture
def root():
    # Unix socket paths must stay under 108 bytes; pytest's tmp_path may not.
    directory = tempfile.mkdtemp(dir="/tmp", prefix="gs-reg-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def kubelet(root):
    kubelet = TestKubelet(os.path.join(root, "dp"), os.path.join(root, "pr", "kubelet.sock"))
    kubelet.start()
    yield kubelet
    kubelet.stop()


@pytest.fixture
def plugin(kubelet):
    server = PluginServer(
        Resources(), MEM, os.path.join(kubelet.device_plugin_dir, "gpushare-memory.sock")
    )
    server.start()
    yield server
    server.stop()


def test_a_resource_registers_and_kubelet_reads_its_devices(kubelet, plugin):
    """register returns True; kubelet saw v1beta1, our endpoint, resource and options,
    dialled back and read the device list."""
    assert register(
        kubelet.kubelet_socket, MEM_NAME, plugin.endpoint, OPTIONS, threading.Event(), 10
    )
    [record] = kubelet.registrations()
    assert (record.version, record.resource_name, record.endpoint, record.error) == (
        API_VERSION,
        MEM_NAME,
        "gpushare-memory.sock",
        None,
    )
    assert record.options.pre_start_required and record.options.get_preferred_allocation_available
    devices = kubelet.wait_for_resource(MEM_NAME, timeout=10)
    assert [d.id for d in devices] == ["GPU-a-_-0", "GPU-a-_-1"]


def test_a_refused_registration_says_why(kubelet, plugin):
    """kubelet refuses an invalid resource name: KubeletUnavailable naming the resource,
    the socket, the gRPC code and kubelet's reason."""
    with pytest.raises(KubeletUnavailable) as refused:
        register(kubelet.kubelet_socket, "gpu-mem", plugin.endpoint, OPTIONS, threading.Event(), 10)
    text = str(refused.value)
    assert text.startswith(f"registering gpu-mem with kubelet at {kubelet.kubelet_socket} failed:")
    assert "INVALID_ARGUMENT" in text and "is invalid" in text
    assert isinstance(refused.value.__cause__, grpc.RpcError)


def test_no_kubelet_socket_is_kubelet_unavailable(root):
    """No kubelet listening: KubeletUnavailable (the run loop retries), not a hang."""
    missing = os.path.join(root, "dp", "kubelet.sock")
    began = time.monotonic()
    with pytest.raises(KubeletUnavailable, match="UNAVAILABLE"):
        register(missing, MEM_NAME, "gpushare-memory.sock", OPTIONS, threading.Event(), 10)
    assert time.monotonic() - began < 9  # failed fast, not at the timeout


class HungRegistration(dp_grpc.RegistrationServicer):
    """A kubelet whose Register never answers; says when a call arrived and ended."""

    def __init__(self):
        self.entered = threading.Event()
        self.cancelled = threading.Event()

    def Register(self, request, context):  # noqa: N802 (gRPC method name)
        context.add_callback(self.cancelled.set)
        self.entered.set()
        self.cancelled.wait(30)
        return dp.Empty()


def test_a_hung_kubelet_never_delays_a_stop(root):
    """While kubelet does not answer, setting ``stop`` makes register return False at once
    and cancels the call (kubelet sees it end)."""
    path = os.path.join(root, "kubelet.sock")
    hung = HungRegistration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    dp_grpc.add_RegistrationServicer_to_server(hung, server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    stop = threading.Event()
    result = []
    caller = threading.Thread(
        target=lambda: result.append(
            register(path, MEM_NAME, "gpushare-memory.sock", OPTIONS, stop, 30)
        )
    )
    try:
        caller.start()
        assert hung.entered.wait(10), "the registration never reached kubelet"
        stop.set()
        caller.join(5)
        assert not caller.is_alive(), "register did not return after stop"
        assert result == [False]
        assert hung.cancelled.wait(5), "the abandoned call was not cancelled"
    finally:
        hung.cancelled.set()
        server.stop(None).wait()
