"""End to end: the real gpushare-node process and a test kubelet that speaks the
real v1beta1 and PodResources gRPC protocols over unix sockets. Pins registration,
admission of shared and whole cards, linkage, release through PodResources,
kubelet restart, and daemon restart after SIGTERM and kill -9."""

import os
import signal
import subprocess
import threading
import time
from concurrent import futures

import grpc
import pytest

from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from standins.daemon_proc import CORE, GPU0, GPU1, MEMORY, WHOLE, Node, _console_script
from standins.kubelet_sim import ContainerSpec, TestKubelet

pytestmark = pytest.mark.e2e

GRACE_SECONDS = 3  # kubelet.allocation_grace_seconds of the Node in standins/daemon_proc.py


@pytest.fixture
def node():
    node = Node()
    kubelet = TestKubelet(node.device_plugin_dir, node.pod_resources_socket)
    kubelet.start()
    node.kubelet = kubelet
    node.start()
    for resource in (MEMORY, CORE, WHOLE):
        kubelet.wait_for_resource(resource, timeout=20)
    yield node
    node.cleanup()
    kubelet.stop()


def health_by_card(devices):
    """card UUID -> set of health values of its devices."""
    health = {}
    for device in devices:
        health.setdefault(device.id.split("-_-")[0], set()).add(device.health)
    return health


def shared_pod(kubelet, name, memory_gib, core_percent, order=None):
    requests = {MEMORY: memory_gib, CORE: core_percent}
    return kubelet.admit_pod("default", name, [ContainerSpec("main", requests)], order=order)


def test_three_resources_registered_with_the_right_counts(node):
    kubelet = node.kubelet
    assert len(kubelet.devices(MEMORY)) == 30
    assert len(kubelet.devices(CORE)) == 200
    assert sorted(d.id for d in kubelet.devices(WHOLE)) == [GPU0, GPU1]
    assert all(d.health == "Healthy" for r in (MEMORY, CORE, WHOLE) for d in kubelet.devices(r))
    for resource in (MEMORY, CORE, WHOLE):
        options = kubelet.options(resource)
        assert options.get_preferred_allocation_available and options.pre_start_required


@pytest.mark.parametrize("order", [[MEMORY, CORE], [CORE, MEMORY]])
def test_memory_and_share_on_one_card_whichever_kubelet_allocates_first(node, order):
    result = shared_pod(node.kubelet, "job-1", 4, 30, order=order)
    assert result.ok, result.error
    [container] = result.containers
    envs = container.envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == GPU0
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert envs["ALIYUN_COM_GPU_MEM_IDX"] == "0"
    assert envs["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4"
    assert envs["ALIYUN_COM_GPU_MEM_DEV"] == "15"
    assert envs["GPUSHARE_ALLOCATION_ID"].startswith("ga-")
    # kubelet's IDs themselves are on that one card
    for ids in container.device_ids.values():
        assert {i.split("-_-")[0] for i in ids} == {GPU0}
    # The second response agrees with the first wherever they overlap.
    first, second = (container.responses[r].envs for r in order)
    assert all(second[name] == value for name, value in first.items())

    again = shared_pod(node.kubelet, "job-2", 4, 30)
    assert again.ok, again.error
    assert again.containers[0].envs["NVIDIA_VISIBLE_DEVICES"] == GPU0  # binpack
    [a, b] = node.allocations()
    assert a["cards"] == b["cards"] == [GPU0]


def test_16_gib_is_refused_clearly_and_changes_nothing(node):
    before = {r: node.kubelet.devices(r) for r in (MEMORY, CORE, WHOLE)}
    result = node.kubelet.admit_pod("default", "big", [ContainerSpec("main", {MEMORY: 16})])
    assert not result.ok
    assert "no single GPU on node-a has 16 GiB free" in result.error
    assert "GPU0 (Tesla T4) has 15 GiB/100% free" in result.error
    # ... and what it means for the pod, which kubelet never admits again.
    assert "kubelet rejects the pod for good (UnexpectedAdmissionError) and never retries" in (
        result.error
    )
    assert node.allocations() == []
    # A change that does move a device list: GPU0's whole-card device turns Unhealthy
    # once a shared pod lands there. The lists kubelet holds when that arrives include
    # whatever the refusal changed, so anything beyond the marker would show.
    assert shared_pod(node.kubelet, "marker", 1, 1).ok
    node.kubelet.wait_for_devices(WHOLE, lambda ds: health_by_card(ds)[GPU0] == {"Unhealthy"})
    assert {r: node.kubelet.devices(r) for r in (MEMORY, CORE)} == {
        r: before[r] for r in (MEMORY, CORE)
    }
    assert health_by_card(node.kubelet.devices(WHOLE))[GPU1] == {"Healthy"}


def test_a_whole_card_pod_admitted_before_kubelets_list_caught_up_gets_a_free_card(node):
    """A share lands on GPU0 and kubelet admits a whole-card pod before the ListAndWatch
    update marking GPU0 Unhealthy reached it: the whole-card pod gets GPU1 (GPU0 would be
    refused at Allocate, failing the pod for good)."""
    kubelet = node.kubelet
    with kubelet.device_list_in_flight(WHOLE):
        assert shared_pod(kubelet, "share", 2, 10).ok  # binpack: GPU0
        held = kubelet.wait_in_flight(WHOLE)  # the update came, kubelet does not see it
        assert health_by_card(held)[GPU0] == {"Unhealthy"}
        assert health_by_card(kubelet.devices(WHOLE))[GPU0] == {"Healthy"}
        result = kubelet.admit_pod("default", "whole", [ContainerSpec("main", {WHOLE: 1})])
    assert result.ok, result.error
    assert result.containers[0].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1


def test_a_whole_card_pod_on_a_stale_list_with_no_free_card_is_refused_clearly(node):
    """Both cards hold shares and kubelet's whole-card list has caught up with neither: the
    refusal names both cards, what they hold and that kubelet's device list was stale."""
    kubelet = node.kubelet
    with kubelet.device_list_in_flight(WHOLE):
        # Memory first: without the Kubernetes API a container's share alone could be
        # placed where its memory does not follow.
        assert shared_pod(kubelet, "share-0", 10, 10, order=[MEMORY, CORE]).ok
        assert shared_pod(kubelet, "share-1", 10, 10, order=[MEMORY, CORE]).ok  # GPU1
        result = kubelet.admit_pod("default", "whole", [ContainerSpec("main", {WHOLE: 1})])
    assert not result.ok
    assert result.reason == "UnexpectedAdmissionError"
    assert f"GPU0 ({GPU0}) holds shared allocations (1)" in result.error
    assert f"GPU1 ({GPU1}) holds shared allocations (1)" in result.error
    assert "kubelet's device list was stale" in result.error
    assert len(node.allocations()) == 2


def test_linkage_and_release_through_pod_resources(node):
    kubelet = node.kubelet
    assert shared_pod(kubelet, "notebook", 2, 20).ok
    kubelet.wait_for_devices(WHOLE, lambda ds: health_by_card(ds)[GPU0] == {"Unhealthy"})
    assert health_by_card(kubelet.devices(WHOLE))[GPU1] == {"Healthy"}

    whole = kubelet.admit_pod("default", "trainer", [ContainerSpec("main", {WHOLE: 1})])
    assert whole.ok, whole.error
    assert whole.containers[0].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in whole.containers[0].envs
    for resource in (MEMORY, CORE):
        kubelet.wait_for_devices(
            resource,
            lambda ds: health_by_card(ds) == {GPU0: {"Healthy"}, GPU1: {"Unhealthy"}},
        )
    # kubelet now has no card to give a second whole-card pod.
    refused = kubelet.admit_pod("default", "trainer-2", [ContainerSpec("main", {WHOLE: 1})])
    assert not refused.ok

    kubelet.remove_pod("default", "notebook")
    kubelet.remove_pod("default", "trainer")
    for resource in (MEMORY, CORE, WHOLE):
        kubelet.wait_for_devices(resource, lambda ds: all(d.health == "Healthy" for d in ds))
    node.wait_for(lambda: node.allocations() == [], what="allocations released")


def test_prestart_and_reconcile_fill_in_the_owner(node):
    result = node.kubelet.admit_pod(
        "ml", "notebook-0", [ContainerSpec("jupyter", {MEMORY: 3, CORE: 25})]
    )
    assert result.ok, result.error
    node.kubelet.start_container("ml", "notebook-0", "jupyter")
    [allocation] = node.wait_for(
        lambda: [a for a in node.allocations() if a["pod"]], what="owner filled in"
    )
    assert (allocation["namespace"], allocation["pod"], allocation["container"]) == (
        "ml",
        "notebook-0",
        "jupyter",
    )
    assert allocation["memory_mib"] == 3072 and allocation["core_percent"] == 25


def test_kubelet_restart_is_followed_by_registration_within_seconds(node):
    kubelet = node.kubelet
    assert shared_pod(kubelet, "before", 4, 30).ok
    registrations = len(kubelet.registrations())
    started = time.monotonic()
    kubelet.restart()
    for resource in (MEMORY, CORE, WHOLE):
        kubelet.wait_for_resource(resource, timeout=10)
    assert time.monotonic() - started < 10
    assert len(kubelet.registrations()) >= registrations + 3
    # Same devices and linkage as before the restart.
    assert health_by_card(kubelet.devices(WHOLE))[GPU0] == {"Unhealthy"}
    assert shared_pod(kubelet, "after", 4, 30).ok


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_daemon_restart_serves_the_same_devices_and_health(node, how):
    kubelet = node.kubelet
    assert shared_pod(kubelet, "survivor", 4, 30).ok
    kubelet.wait_for_devices(WHOLE, lambda ds: health_by_card(ds)[GPU0] == {"Unhealthy"})
    before = node.allocations()
    registrations = len(kubelet.registrations())
    started = time.monotonic()
    node.signal(how)
    code = node.wait(timeout=10)
    if how == signal.SIGTERM:
        assert code == 0 and time.monotonic() - started < 5
        assert not [n for n in os.listdir(node.device_plugin_dir) if n.startswith("gpushare")]
    node.start()
    node.wait_for(
        lambda: len(kubelet.registrations()) >= registrations + 3, what="registration again"
    )
    for resource in (MEMORY, CORE):
        kubelet.wait_for_devices(resource, lambda ds: all(d.health == "Healthy" for d in ds))
    kubelet.wait_for_devices(WHOLE, lambda ds: health_by_card(ds)[GPU0] == {"Unhealthy"})
    assert [a["id"] for a in node.allocations()] == [a["id"] for a in before]
    # The next container still binpacks next to the survivor, within what is left.
    after = shared_pod(kubelet, "next", 11, 70)
    assert after.ok, after.error
    assert after.containers[0].envs["NVIDIA_VISIBLE_DEVICES"] == GPU0
    full = shared_pod(kubelet, "one-too-many", 1, 1)
    assert full.ok, full.error
    assert full.containers[0].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1


def test_bad_config_exits_2_with_one_line_naming_the_key():
    node = Node(resources={"placement": "bestfit"})
    try:
        out = subprocess.run(
            [*_console_script("gpushare-node"), "--config", node.config_path],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "resources.placement" in lines[0]
    finally:
        node.cleanup()


def test_sigterm_stops_within_5_s_while_kubelet_hangs_in_register():
    hung, released = threading.Event(), threading.Event()

    class HangingRegistration(dp_grpc.RegistrationServicer):
        def Register(self, request, context):  # noqa: N802 (gRPC method name)
            hung.set()
            released.wait(30)  # a kubelet that never answers (until the test ends)
            return dp.Empty()

    node = Node()
    os.makedirs(node.device_plugin_dir)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    dp_grpc.add_RegistrationServicer_to_server(HangingRegistration(), server)
    server.add_insecure_port(f"unix://{os.path.join(node.device_plugin_dir, 'kubelet.sock')}")
    server.start()
    try:
        node.start()
        assert hung.wait(20), node.log()
        started = time.monotonic()
        node.signal(signal.SIGTERM)
        assert node.wait(timeout=10) == 0
        assert time.monotonic() - started < 5
    finally:
        released.set()
        server.stop(0)
        node.cleanup()


def test_admission_goes_on_and_nothing_is_released_while_pod_resources_is_down(node):
    kubelet = node.kubelet
    assert shared_pod(kubelet, "first", 2, 10).ok
    node.wait_for(lambda: [a for a in node.allocations() if a["pod"]], what="owner")
    kubelet.set_pod_resources_available(False)
    assert shared_pod(kubelet, "second", 2, 10).ok
    admitted = time.monotonic()
    at_grace = {}

    def skipped_after_grace():
        """A reconcile was tried (and skipped) after the second allocation's grace period
        ran out: it is unconfirmed, but kubelet could not be asked."""
        if time.monotonic() < admitted + GRACE_SECONDS:
            return False
        count = node.log().count("reconcile skipped")
        at_grace.setdefault("count", count)
        return count > at_grace["count"]

    node.wait_for(skipped_after_grace, timeout=20, what="a skipped reconcile after the grace")
    assert len(node.allocations()) == 2
    kubelet.set_pod_resources_available(True)
    node.wait_for(lambda: all(a["pod"] for a in node.allocations()), what="both confirmed")


def test_bad_requests_get_grpc_errors_a_cluster_admin_understands(node):
    def call(socket_name, ids):
        path = os.path.join(node.device_plugin_dir, socket_name)
        with grpc.insecure_channel(f"unix://{path}") as channel:
            request = dp.AllocateRequest(
                container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)]
            )
            with pytest.raises(grpc.RpcError) as refused:
                dp_grpc.DevicePluginStub(channel).Allocate(request, timeout=10)
            return refused.value

    unknown = call("gpushare-memory.sock", ["GPU-gone-_-0"])
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown device IDs [GPU-gone-_-0] on node-a" in unknown.details()

    # The memory lands on GPU0; the same container's share then names GPU1.
    ok = node.kubelet.admit_pod("default", "m", [ContainerSpec("main", {MEMORY: 1})])
    assert ok.ok
    disagree = call("gpushare-core.sock", [f"{GPU1}-_-c0"])
    assert disagree.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "both must be on one card" in disagree.details()
    assert len(node.allocations()) == 1
