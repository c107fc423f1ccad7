"""Pins nodemgr.kubelet.podresources.PodResourcesClient against the test kubelet: kubelet's
record comes back as {container: {resource: device IDs}}, kubelet's one-entry-per-device
answer merged per resource, containers holding nothing left out; a kubelet that does not
answer (down, or its socket missing) raises KubeletUnavailable naming the socket and the
config key, never an empty record; the client survives kubelet recreating its socket."""

import os
import shutil
import tempfile
import threading

import pytest

from nodemgr.allocation.resources import AllocateResult, DeviceInfo
from nodemgr.common.changes import ChangeCounter
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import ContainerRef
from nodemgr.kubelet.podresources import PodResourcesClient
from nodemgr.kubelet.registration import KubeletUnavailable, register
from nodemgr.kubelet.servicer import OPTIONS, PluginServer
from standins.kubelet_sim import ContainerSpec, TestKubelet

MEM = ResourceKind.MEMORY
MEM_NAME = "aliyun.com/gpu-mem"


class Resources:
    """A device plugin's allocation state: four devices, every Allocate accepted."""

    resource_names = {MEM: MEM_NAME}

    def __init__(self):
        self.device_changes = ChangeCounter()

    def devices(self, kind):
        return [DeviceInfo(f"GPU-a-_-{j}", True, j % 2) for j in range(4)]

    def preferred(self, kind, available, must_include, size):
        return list(available)[:size]

    def allocate(self, kind, device_ids):
        return AllocateResult("ga-1", {"GPUSHARE_ALLOCATION_ID": "ga-1"})

    def check_known(self, kind, device_ids):
        pass


@pytest.fixture
def root():
    # Unix socket paths must stay under 108 bytes; pytest's tmp_path may not.
    directory = tempfile.mkdtemp(dir="/tmp", prefix="gs-pr-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def kubelet(root):
    kubelet = TestKubelet(os.path.join(root, "dp"), os.path.join(root, "pr", "kubelet.sock"))
    kubelet.start()
    server = PluginServer(
        Resources(), MEM, os.path.join(kubelet.device_plugin_dir, "gpushare-memory.sock")
    )
    server.start()
    assert register(
        kubelet.kubelet_socket, MEM_NAME, server.endpoint, OPTIONS, threading.Event(), 10
    )
    kubelet.wait_for_resource(MEM_NAME)
    yield kubelet
    server.stop()
    kubelet.stop()


@pytest.fixture
def client(kubelet):
    client = PodResourcesClient(kubelet.pod_resources_socket, timeout_seconds=5)
    yield client
    client.close()


def test_kubelets_record_per_container_and_resource(kubelet, client):
    """Two pods' containers with their device IDs, each resource's entries merged in
    order; a container holding no device is not in the record."""
    assert kubelet.admit_pod(
        "ml", "train-0", [ContainerSpec("main", {MEM_NAME: 2}), ContainerSpec("sidecar", {})]
    ).ok
    assert kubelet.admit_pod("ml", "train-1", [ContainerSpec("main", {MEM_NAME: 1})]).ok
    record = client.list()
    assert record == {
        ContainerRef("ml", "train-0", "main"): {MEM_NAME: ["GPU-a-_-0", "GPU-a-_-1"]},
        ContainerRef("ml", "train-1", "main"): {MEM_NAME: ["GPU-a-_-2"]},
    }


def test_an_empty_node_is_an_empty_record(client):
    """No pods: an empty record (the one case where empty is the truth)."""
    assert client.list() == {}


def test_a_kubelet_that_does_not_answer_is_never_an_empty_record(kubelet, client):
    """kubelet's PodResources server answers UNAVAILABLE: KubeletUnavailable naming the
    socket, the code and where to fix the path; no record at all."""
    kubelet.set_pod_resources_available(False)
    with pytest.raises(KubeletUnavailable) as refused:
        client.list()
    text = str(refused.value)
    assert text.startswith(f"kubelet PodResources API at {kubelet.pod_resources_socket} did not")
    assert "UNAVAILABLE" in text and "kubelet.pod_resources_socket" in text


def test_no_socket_is_kubelet_unavailable(root):
    """Nobody at the socket path: KubeletUnavailable, within the client's timeout."""
    client = PodResourcesClient(os.path.join(root, "none.sock"), timeout_seconds=2)
    try:
        with pytest.raises(KubeletUnavailable, match="is kubelet running"):
            client.list()
    finally:
        client.close()


def test_the_client_survives_kubelet_recreating_its_socket(kubelet, client):
    """kubelet restarts (its socket deleted and made again): the same client reads the
    record again, allocations restored from kubelet's checkpoint."""
    assert kubelet.admit_pod("ml", "train-0", [ContainerSpec("main", {MEM_NAME: 1})]).ok
    before = client.list()
    kubelet.restart()
    assert client.list() == before


def test_an_unchanged_answer_gives_back_the_same_record(kubelet, client):
    """While kubelet's answer is byte for byte the same, list() returns the record built
    last time (the allocator then skips it); a changed answer is read anew."""
    assert kubelet.admit_pod("ml", "train-0", [ContainerSpec("main", {MEM_NAME: 1})]).ok
    first = client.list()
    assert client.list() is first
    assert kubelet.admit_pod("ml", "train-1", [ContainerSpec("main", {MEM_NAME: 1})]).ok
    second = client.list()
    assert second is not first and len(second) == 2


def test_an_answer_that_is_no_record_is_kubelet_unavailable(client, monkeypatch):
    """Bytes that do not parse as a ListPodResourcesResponse: KubeletUnavailable naming the
    socket, never an empty record."""
    monkeypatch.setattr(client, "_list", lambda request, timeout: b"\xff\xff\xff")
    with pytest.raises(KubeletUnavailable, match="not a ListPodResourcesResponse"):
        client.list()


def test_claims_devices_of_this_driver_join_the_record_once_each(root):
    """With dra_driver: each container's dynamic_resources devices of that driver are in
    the record under the claims pseudo resource (kubelet's repeats and other drivers'
    devices left out; no share ID reported is an empty one)."""
    from nodemgr.domain.podtie import CLAIMS_RECORD, claim_record_id
    from nodemgr.kubelet.api import podresources_v1_pb2 as pr

    response = pr.ListPodResourcesResponse()
    pod = response.pod_resources.add(name="p", namespace="ns")
    container = pod.containers.add(name="main")
    claim = container.dynamic_resources.add(claim_name="c1", claim_namespace="ns")
    for driver, device, share in [
        ("gpushare.aliyun.com", "gpu-a", "s-1"),
        ("gpushare.aliyun.com", "gpu-a", "s-1"),  # kubelet records a retried device again
        ("other.example.com", "gpu-a", "s-1"),
    ]:
        claim.claim_resources.add(driver_name=driver, pool_name="node-a", device_name=device,
                                  share_id=share)  # fmt: skip
    claim.claim_resources.add(driver_name="gpushare.aliyun.com", pool_name="node-a",
                              device_name="gpu-b")  # fmt: skip
    client = PodResourcesClient(os.path.join(root, "none.sock"), dra_driver="gpushare.aliyun.com")
    client._list = lambda request, timeout: response.SerializeToString()
    record = client.list()
    assert record[ContainerRef("ns", "p", "main")][CLAIMS_RECORD] == [
        claim_record_id("ns", "c1", "node-a", "gpu-a", "s-1"),
        claim_record_id("ns", "c1", "node-a", "gpu-b", ""),
    ]
    client.close()
    plain = PodResourcesClient(os.path.join(root, "none.sock"))
    plain._list = lambda request, timeout: response.SerializeToString()
    assert plain.list() == {}
    plain.close()
