"""Tests of the test kubelet (standins/kubelet_sim.py) against a tiny fake device plugin.

The fake plugin is a real gRPC server on a unix socket that registers itself
through kubelet.sock, so these tests exercise the real wire protocols in both
directions: registration and its dial-back, ListAndWatch, preferred allocation,
Allocate, PreStartContainer, the PodResources server, and kubelet restarts; and the
parts of kubelet's behaviour a plugin sees (checked against kubelet's device manager,
docs/kubelet-api.md): a container's resources in a random, seedable order; responses
merged in another, the first env of a name winning; an admission error rejecting the pod
for good (UnexpectedAdmissionError) and freeing its devices at once, as a removed pod's
are; PreStartContainer at every start and again at a restart, without Allocate; the
node's capacity 0 after a restart until the next node status update.

Unix socket paths must stay under 108 bytes, so every test works in a short
directory from ``tempfile.mkdtemp(prefix="ks")`` under /tmp rather than in
pytest's (long) tmp_path.

Why this module is longer than 400 lines: it holds the kubelet stand-in to kubelet's
behaviour message by message, as the stand-in itself is large.
"""

import os
import shutil
import tempfile
import threading
import time
from concurrent import futures

import grpc
import pytest

from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from nodemgr.kubelet.api import podresources_v1_pb2 as pr
from nodemgr.kubelet.api import podresources_v1_pb2_grpc as pr_grpc
from standins import kubelet_sim
from standins.kubelet_sim import (
    THREAD_PREFIX,
    ContainerSpec,
    PluginError,
    TestKubelet,
    is_extended_resource_name,
)

RESOURCE = "example.com/gpu"


class FakePlugin(dp_grpc.DevicePluginServicer):
    """A minimal device plugin serving ``n`` devices ``<prefix>-0`` .. ``<prefix>-<n-1>``.

    GetPreferredAllocation answers the last ``allocation_size`` available IDs
    (or ``preferred_answer`` when set; ``preferred_error`` refuses); Allocate
    answers envs ``{"IDS": ..., "FROM": tag}`` and one mount at ``mount_path``
    (default ``/<tag>``) from ``/host/<tag>``. Every call is recorded in ``calls``
    as (method, request).
    """

    def __init__(
        self,
        plugin_dir: str,
        n: int = 4,
        *,
        socket: str = "fake.sock",
        prefix: str = "dev",
        tag: str = "fake",
        preferred: bool = True,
        pre_start: bool = False,
        numa: dict[str, list[int]] | None = None,
        mount_path: str | None = None,
    ):
        self.plugin_dir = plugin_dir
        self.socket = socket
        self.tag = tag
        self.mount_path = mount_path or f"/{tag}"
        self.options = dp.DevicePluginOptions(
            pre_start_required=pre_start, get_preferred_allocation_available=preferred
        )
        numa = numa or {}
        self.devices = [
            dp.Device(
                ID=f"{prefix}-{i}",
                health="Healthy",
                topology=dp.TopologyInfo(
                    nodes=[dp.NUMANode(ID=node) for node in numa.get(f"{prefix}-{i}", [])]
                ),
            )
            for i in range(n)
        ]
        self.preferred_answer: list[str] | None = None
        self.preferred_error: tuple[grpc.StatusCode, str] | None = None
        self.allocate_error: tuple[grpc.StatusCode, str] | None = None
        self.pre_start_error: tuple[grpc.StatusCode, str] | None = None
        self.calls: list[tuple[str, object]] = []
        self.active_streams = 0
        self._cond = threading.Condition()
        self._version = 0  # bumped on every device list change
        self._epoch = 0  # bumped by end_streams(): streams of older epochs return

        self._executor = futures.ThreadPoolExecutor(max_workers=8)
        self._server = grpc.server(self._executor)
        dp_grpc.add_DevicePluginServicer_to_server(self, self._server)
        self._server.add_insecure_port("unix://" + os.path.join(plugin_dir, socket))
        self._server.start()

    # --- test controls

    def register(self, kubelet_socket: str, resource: str = RESOURCE, version: str = "v1beta1"):
        """Call Registration.Register on kubelet.sock, as a plugin does."""
        with grpc.insecure_channel("unix://" + kubelet_socket) as channel:
            dp_grpc.RegistrationStub(channel).Register(
                dp.RegisterRequest(
                    version=version,
                    endpoint=self.socket,
                    resource_name=resource,
                    options=self.options,
                ),
                timeout=15,
            )

    def set_health(self, device_id: str, health: str) -> None:
        with self._cond:
            for device in self.devices:
                if device.ID == device_id:
                    device.health = health
            self._version += 1
            self._cond.notify_all()

    def end_streams(self) -> None:
        """End every open ListAndWatch stream normally (the plugin keeps serving)."""
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def count(self, method: str) -> int:
        with self._cond:
            return sum(1 for name, _ in self.calls if name == method)

    def requests(self, method: str) -> list:
        with self._cond:
            return [request for name, request in self.calls if name == method]

    def stop(self) -> None:
        self._server.stop(grace=None).wait()
        self._executor.shutdown(wait=True)

    # --- DevicePlugin service

    def _record(self, method: str, request) -> None:
        with self._cond:
            self.calls.append((method, request))

    def GetDevicePluginOptions(self, request, context):  # noqa: N802
        self._record("GetDevicePluginOptions", request)
        return self.options

    def ListAndWatch(self, request, context):  # noqa: N802
        self._record("ListAndWatch", request)
        with self._cond:
            epoch = self._epoch
            self.active_streams += 1
        try:
            sent = None
            while context.is_active():
                with self._cond:
                    if self._epoch != epoch:
                        return
                    if sent == self._version:
                        self._cond.wait(0.05)
                        continue
                    sent = self._version
                    response = dp.ListAndWatchResponse(devices=self.devices)
                yield response
        finally:
            with self._cond:
                self.active_streams -= 1

    def GetPreferredAllocation(self, request, context):  # noqa: N802
        self._record("GetPreferredAllocation", request)
        if self.preferred_error:
            context.abort(*self.preferred_error)
        answers = []
        for creq in request.container_requests:
            if self.preferred_answer is not None:
                ids = self.preferred_answer
            else:
                ids = list(creq.available_deviceIDs)[-creq.allocation_size :]
            answers.append(dp.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return dp.PreferredAllocationResponse(container_responses=answers)

    def Allocate(self, request, context):  # noqa: N802
        self._record("Allocate", request)
        if self.allocate_error:
            context.abort(*self.allocate_error)
        return dp.AllocateResponse(
            container_responses=[
                dp.ContainerAllocateResponse(
                    envs={"IDS": ",".join(creq.devices_ids), "FROM": self.tag},
                    mounts=[
                        dp.Mount(container_path=self.mount_path, host_path=f"/host/{self.tag}")
                    ],
                )
                for creq in request.container_requests
            ]
        )

    def PreStartContainer(self, request, context):  # noqa: N802
        self._record("PreStartContainer", request)
        if self.pre_start_error:
            context.abort(*self.pre_start_error)
        return dp.PreStartContainerResponse()


def _sim_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="ks", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(workdir):
    sim = TestKubelet(os.path.join(workdir, "dp"), os.path.join(workdir, "pr", "kubelet.sock"))
    sim.start()
    yield sim
    sim.stop()
    # stop() joins everything it started: nothing may leak into the next test.
    assert _sim_threads() == []
    assert not os.path.exists(sim.kubelet_socket)
    assert not os.path.exists(sim.pod_resources_socket)


@pytest.fixture
def make_plugin(kubelet):
    """Factory of FakePlugins serving in the kubelet's device plugin directory."""
    made: list[FakePlugin] = []

    def make(**kwargs) -> FakePlugin:
        plugin = FakePlugin(kubelet.device_plugin_dir, **kwargs)
        made.append(plugin)
        return plugin

    yield make
    for plugin in made:
        plugin.stop()


def _pod_resources(kubelet: TestKubelet, method: str, request):
    with grpc.insecure_channel("unix://" + kubelet.pod_resources_socket) as channel:
        return getattr(pr_grpc.PodResourcesListerStub(channel), method)(request, timeout=5)


def _by_resource(devices) -> dict[str, list[str]]:
    """Merge ContainerDevices entries (kubelet sends one per device) by resource."""
    out: dict[str, list[str]] = {}
    for entry in devices:
        out.setdefault(entry.resource_name, []).extend(entry.device_ids)
    return out


# ---------------------------------------------------------------- registration


def test_register_dials_back_for_options_then_runs_list_and_watch(kubelet, make_plugin):
    plugin = make_plugin(n=4)
    plugin.register(kubelet.kubelet_socket)
    # kubelet asks for the options before Register returns.
    assert plugin.count("GetDevicePluginOptions") == 1

    devices = kubelet.wait_for_resource(RESOURCE)
    assert [d.id for d in devices] == ["dev-0", "dev-1", "dev-2", "dev-3"]
    assert all(d.healthy for d in devices)
    assert plugin.count("ListAndWatch") == 1
    assert kubelet.options(RESOURCE) == plugin.options

    [record] = kubelet.registrations()
    assert (record.resource_name, record.endpoint, record.version) == (
        RESOURCE,
        "fake.sock",
        "v1beta1",
    )
    assert record.options == plugin.options and record.error is None


def test_each_list_replaces_the_previous_one(kubelet, make_plugin):
    plugin = make_plugin(n=3)
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)

    plugin.set_health("dev-1", "Unhealthy")
    plugin.set_health("dev-2", "healthy")  # anything but exactly "Healthy" is unhealthy
    devices = kubelet.wait_for_devices(RESOURCE, lambda ds: not ds[1].healthy)
    assert [d.healthy for d in devices] == [True, False, False]
    assert devices[2].health == "healthy"  # the plugin's string, as sent

    # Unhealthy devices are not allocatable.
    reply = _pod_resources(kubelet, "GetAllocatableResources", pr.AllocatableResourcesRequest())
    assert _by_resource(reply.devices) == {RESOURCE: ["dev-0"]}


def test_updates_in_flight_are_applied_only_on_leaving(kubelet, make_plugin):
    """device_list_in_flight: an update received meanwhile does not change the list an
    admission sees (it offers the device the plugin marked Unhealthy); the latest one is
    applied on leaving."""
    plugin = make_plugin(n=2)
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)
    with kubelet.device_list_in_flight(RESOURCE):
        plugin.set_health("dev-0", "Unhealthy")
        held = kubelet.wait_in_flight(RESOURCE)
        assert [d.healthy for d in held] == [False, True]  # it came
        assert all(d.healthy for d in kubelet.devices(RESOURCE))  # and is not seen yet
        result = kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 2})])
        assert result.ok, result.error
    devices = kubelet.wait_for_devices(RESOURCE, lambda ds: not ds[0].healthy, timeout=5)
    assert [d.healthy for d in devices] == [False, True]


@pytest.mark.parametrize(
    ("version", "resource"),
    [
        ("v1alpha", RESOURCE),
        ("", RESOURCE),
        ("v1beta1", "gpu"),
        ("v1beta1", "kubernetes.io/gpu"),
        ("v1beta1", "foo.kubernetes.io/gpu"),
        ("v1beta1", "Example.com/gpu"),
        ("v1beta1", "example.com/"),
        ("v1beta1", "example.com/-gpu"),
        ("v1beta1", "example.com/a/b"),
        ("v1beta1", "example.com/" + "x" * 64),
        ("v1beta1", "requests.example.com/gpu"),
    ],
)
def test_register_refuses_wrong_version_or_invalid_name(kubelet, make_plugin, version, resource):
    plugin = make_plugin()
    with pytest.raises(grpc.RpcError) as caught:
        plugin.register(kubelet.kubelet_socket, resource=resource, version=version)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert plugin.calls == []  # refused before dialling back
    [record] = kubelet.registrations()
    assert record.resource_name == resource and record.error
    assert kubelet.devices(resource) == []


@pytest.mark.parametrize(
    "name", ["nvidia.com/gpu", "aliyun.com/gpu-mem", "example.com/Gpu_count.v1", "a.b/" + "x" * 63]
)
def test_valid_extended_resource_names(name):
    assert is_extended_resource_name(name)


def test_register_fails_when_the_plugin_does_not_serve(kubelet, monkeypatch):
    monkeypatch.setattr(kubelet_sim, "DIAL_TIMEOUT_S", 0.5)
    with grpc.insecure_channel("unix://" + kubelet.kubelet_socket) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            dp_grpc.RegistrationStub(channel).Register(
                dp.RegisterRequest(version="v1beta1", endpoint="none.sock", resource_name=RESOURCE),
                timeout=10,
            )
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert "none.sock" in caught.value.details()
    assert kubelet.registrations()[0].error


def list_and_watch_readers():
    """The test kubelet's live ListAndWatch reader threads of RESOURCE."""
    name = f"{THREAD_PREFIX}-listandwatch-{RESOURCE}"
    return [t for t in threading.enumerate() if t.name == name]


def test_reregistration_replaces_the_endpoint(kubelet, make_plugin):
    first = make_plugin(n=2, socket="first.sock", prefix="old")
    first.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)
    [old_reader] = list_and_watch_readers()

    second = make_plugin(n=3, socket="second.sock", prefix="new")
    second.register(kubelet.kubelet_socket)
    devices = kubelet.wait_for_devices(RESOURCE, lambda ds: ds and ds[0].id == "new-0")
    assert [d.id for d in devices] == ["new-0", "new-1", "new-2"]

    # The old channel is closed, which ends the old stream; its end must not
    # mark the new plugin's devices unhealthy.
    deadline = time.monotonic() + 5
    while first.active_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.active_streams == 0
    old_reader.join(5)  # kubelet's reader of the old stream has done all it does at its end
    assert not old_reader.is_alive()
    assert all(d.healthy for d in kubelet.devices(RESOURCE))

    result = kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 1})])
    assert result.ok, result.error
    assert first.count("Allocate") == 0 and second.count("Allocate") == 1


@pytest.mark.parametrize("how", ["stream ends", "plugin dies"])
def test_stream_end_marks_devices_unhealthy_and_is_not_retried(kubelet, make_plugin, how):
    plugin = make_plugin(n=2)
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)
    [reader] = list_and_watch_readers()

    if how == "stream ends":
        plugin.end_streams()
    else:
        plugin.stop()
    devices = kubelet.wait_for_devices(RESOURCE, lambda ds: not any(d.healthy for d in ds))
    assert [d.health for d in devices] == ["Unhealthy", "Unhealthy"]
    reader.join(5)  # the reader is done: nothing is left that could call it again
    assert not reader.is_alive()
    assert plugin.count("ListAndWatch") == 1  # kubelet never calls it again

    result = kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 1})])
    assert not result.ok
    assert "Available: 0" in result.error

    if how == "stream ends":
        # The plugin must register again to be listed again.
        plugin.register(kubelet.kubelet_socket)
        devices = kubelet.wait_for_resource(RESOURCE)
        kubelet.wait_for_devices(RESOURCE, lambda ds: all(d.healthy for d in ds))
        assert plugin.count("ListAndWatch") == 2


# ---------------------------------------------------------------- admission


def test_admission_uses_the_preferred_allocation(kubelet, make_plugin):
    plugin = make_plugin(n=4)
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)

    result = kubelet.admit_pod("ns", "p1", [ContainerSpec("c", {RESOURCE: 2})])
    assert result.ok and result.error is None
    [admission] = result.containers
    assert admission.device_ids == {RESOURCE: ["dev-2", "dev-3"]}
    assert admission.preferred == {RESOURCE: ["dev-2", "dev-3"]}
    assert admission.envs == {"IDS": "dev-2,dev-3", "FROM": "fake"}

    [preferred_request] = plugin.requests("GetPreferredAllocation")
    [creq] = preferred_request.container_requests
    assert list(creq.available_deviceIDs) == ["dev-0", "dev-1", "dev-2", "dev-3"]
    assert list(creq.must_include_deviceIDs) == [] and creq.allocation_size == 2

    # Allocate gets exactly one container request with exactly the preferred IDs.
    [allocate_request] = plugin.requests("Allocate")
    assert [list(c.devices_ids) for c in allocate_request.container_requests] == [
        ["dev-2", "dev-3"]
    ]

    # The next pod only sees the devices still free.
    result = kubelet.admit_pod("ns", "p2", [ContainerSpec("c", {RESOURCE: 1})])
    assert result.containers[0].device_ids == {RESOURCE: ["dev-1"]}
    creq = plugin.requests("GetPreferredAllocation")[1].container_requests[0]
    assert list(creq.available_deviceIDs) == ["dev-0", "dev-1"]


def test_invalid_preferred_answer_is_completed_from_available(kubelet, make_plugin):
    plugin = make_plugin(n=4)
    plugin.preferred_answer = ["nope", "dev-1", "dev-1"]
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)

    result = kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 3})])
    assert result.ok
    # The usable part of the answer is kept; the rest comes in list order.
    assert result.containers[0].device_ids == {RESOURCE: ["dev-1", "dev-0", "dev-2"]}


def test_without_preferred_option_devices_come_in_list_order(kubelet, make_plugin):
    plugin = make_plugin(n=3, preferred=False)
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)

    result = kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 2})])
    assert result.containers[0].device_ids == {RESOURCE: ["dev-0", "dev-1"]}
    assert plugin.count("GetPreferredAllocation") == 0


def two_resources(kubelet, make_plugin, n=2, **kwargs):
    """Plugins of example.com/a and example.com/b (tags a and b) registered with ``kubelet``."""
    plugins = {}
    for name in ("a", "b"):
        plugins[name] = make_plugin(n=n, socket=f"{name}.sock", prefix=name, tag=name, **kwargs)
        plugins[name].register(kubelet.kubelet_socket, resource=f"example.com/{name}")
        kubelet.wait_for_resource(f"example.com/{name}")
    return plugins


BOTH = {"example.com/a": 1, "example.com/b": 1}


def test_envs_merge_first_value_wins_in_a_random_order(kubelet, make_plugin):
    """kubelet merges a container's Allocate answers in a map's order (random, and not the
    order it called the plugins): the first value of an env name and the first mount of a
    container path win ("Skip existing env")."""
    two_resources(kubelet, make_plugin, n=16, mount_path="/shared")
    merged_otherwise = 0
    for i in range(12):
        spec = ContainerSpec("c", BOTH)
        result = kubelet.admit_pod("ns", f"p{i}", [spec], order=["example.com/b", "example.com/a"])
        assert result.ok
        [admission] = result.containers
        assert list(admission.responses) == ["example.com/b", "example.com/a"]  # as called
        assert sorted(admission.merge_order) == ["example.com/a", "example.com/b"]
        first = admission.merge_order[0].removeprefix("example.com/")
        assert admission.envs == {"IDS": admission.device_ids[admission.merge_order[0]][0],
                                  "FROM": first}  # fmt: skip
        assert [(m.container_path, m.host_path) for m in admission.mounts] == [
            ("/shared", f"/host/{first}")
        ]
        merged_otherwise += admission.merge_order != list(admission.responses)
    assert 0 < merged_otherwise < 12


def admission_orders(workdir, seed, pods=16):
    """The order a kubelet of ``seed`` allocates the two resources of each of ``pods``
    single-container pods."""
    sim = TestKubelet(
        os.path.join(workdir, f"dp{seed}"), os.path.join(workdir, f"pr{seed}", "k.sock"), seed=seed
    )
    sim.start()
    plugins = []
    try:
        for name in ("a", "b"):
            plugin = FakePlugin(sim.device_plugin_dir, pods, socket=f"{name}.sock", prefix=name)
            plugins.append(plugin)
            plugin.register(sim.kubelet_socket, resource=f"example.com/{name}")
            sim.wait_for_resource(f"example.com/{name}")
        orders = []
        for i in range(pods):
            seen: list[str] = []
            spec = ContainerSpec("c", BOTH)
            result = sim.admit_pod(
                "ns", f"p{i}", [spec], after_allocate=lambda _c, r, seen=seen: seen.append(r)
            )
            assert result.ok, result.error
            assert seen == list(result.containers[0].responses)
            orders.append(tuple(seen))
        return orders
    finally:
        sim.stop()
        for plugin in plugins:
            plugin.stop()


def test_a_containers_resources_come_in_a_random_order_per_container(workdir, monkeypatch):
    """kubelet ranges over a container's resource map: either resource may come first, drawn
    anew per container. The same seed gives the same orders; GPUSHARE_KUBELET_SEED is the
    seed of a kubelet made without one."""
    orders = admission_orders(workdir, seed=7)
    assert set(orders) == {("example.com/a", "example.com/b"), ("example.com/b", "example.com/a")}
    assert admission_orders(workdir, seed=7) == orders
    monkeypatch.setenv(kubelet_sim.SEED_ENV, "1234")
    assert TestKubelet(os.path.join(workdir, "x"), os.path.join(workdir, "y")).seed == 1234


def test_after_allocate_is_called_after_each_allocate(kubelet, make_plugin):
    """``after_allocate(container, resource)`` runs after each Allocate answered, before the
    next resource's calls: a test can look at the plugin between a container's resources.
    None for a zero request (no Allocate)."""
    plugins = {}
    for name in ("a", "b"):
        plugins[name] = make_plugin(n=2, socket=f"{name}.sock", prefix=name, tag=name)
        plugins[name].register(kubelet.kubelet_socket, resource=f"example.com/{name}")
        kubelet.wait_for_resource(f"example.com/{name}")
    seen = []

    def pause(container, resource):
        seen.append(
            (container, resource, plugins["a"].count("Allocate"), plugins["b"].count("Allocate"))
        )

    spec = ContainerSpec("c", {"example.com/a": 1, "example.com/b": 1, "example.com/z": 0})
    result = kubelet.admit_pod("ns", "p", [spec], order=["example.com/b", "example.com/a"],
                               after_allocate=pause)  # fmt: skip
    assert result.ok, result.error
    assert seen == [("c", "example.com/b", 0, 1), ("c", "example.com/a", 1, 1)]


def test_insufficient_devices_fail_without_allocate(kubelet, make_plugin):
    plugin = make_plugin(n=2)
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)

    result = kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 3})])
    assert not result.ok and result.reason == "UnexpectedAdmissionError"
    assert result.error == (
        f"Allocate failed due to requested number of devices unavailable for {RESOURCE}. "
        "Requested: 3, Available: 2, which is unexpected"
    )
    assert plugin.count("Allocate") == 0
    assert plugin.count("GetPreferredAllocation") == 0


def test_unregistered_resource_fails_admission(kubelet):
    result = kubelet.admit_pod("ns", "p", [ContainerSpec("c", {"example.com/none": 1})])
    assert not result.ok
    assert "example.com/none" in result.error


def test_pod_without_device_requests_needs_no_plugin(kubelet):
    result = kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 0})])
    assert result.ok and result.containers[0].device_ids == {}
    assert kubelet.allocated() == {("ns", "p", "c"): {}}


def test_an_allocate_error_rejects_the_pod_for_good_and_frees_its_devices(kubelet, make_plugin):
    """A refused Allocate fails the pod: UnexpectedAdmissionError with kubelet's message
    (grpc-go's text of the error inside); the pod is never admitted again (not retried), its
    devices, also those allocated before the error, are free for the next pod at once, and
    PodResources lists it without devices until it is removed."""
    good = make_plugin(n=2, socket="good.sock", prefix="g")
    good.register(kubelet.kubelet_socket, resource="example.com/good")
    bad = make_plugin(n=2, socket="bad.sock", prefix="b")
    bad.allocate_error = (grpc.StatusCode.INTERNAL, "no room on any card")
    bad.register(kubelet.kubelet_socket, resource="example.com/bad")
    kubelet.wait_for_resource("example.com/good")
    kubelet.wait_for_resource("example.com/bad")

    spec = ContainerSpec("c", {"example.com/good": 1, "example.com/bad": 1})
    result = kubelet.admit_pod("ns", "p", [spec], order=["example.com/good", "example.com/bad"])
    assert not result.ok and result.reason == "UnexpectedAdmissionError"
    message = (
        "Allocate failed due to rpc error: code = Internal desc = no room on any card, "
        "which is unexpected"
    )
    assert result.error == message == kubelet.rejection("ns", "p")
    assert result.containers[0].device_ids == {"example.com/good": ["g-1"]}
    assert kubelet.allocated() == {("ns", "p", "c"): {}}
    listed = _pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    [(name, container)] = [(p.name, c) for p in listed.pod_resources for c in p.containers]
    assert (name, container.name, list(container.devices)) == ("p", "c", [])
    with pytest.raises(ValueError, match="never admits it again"):
        kubelet.admit_pod("ns", "p", [ContainerSpec("c", {"example.com/good": 1})])
    with pytest.raises(ValueError, match="rejected"):
        kubelet.start_container("ns", "p", "c")
    assert good.count("Allocate") == 1 and bad.count("Allocate") == 1  # never retried

    result = kubelet.admit_pod("ns", "q", [ContainerSpec("c", {"example.com/good": 2})])
    assert result.ok  # g-1 included
    kubelet.remove_pod("ns", "p")
    assert kubelet.rejection("ns", "p") is None
    assert kubelet.admit_pod("ns", "p", [ContainerSpec("c", {})]).ok  # a new pod of that name


def test_a_preferred_allocation_error_rejects_the_pod_too(kubelet, make_plugin):
    """A refused GetPreferredAllocation fails the pod the same way, with kubelet's wording;
    Allocate is not called."""
    plugin = make_plugin(n=2)
    plugin.preferred_error = (grpc.StatusCode.RESOURCE_EXHAUSTED, "no single GPU fits")
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)
    result = kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 1})])
    assert (result.ok, result.reason) == (False, "UnexpectedAdmissionError")
    assert result.error == (
        "Allocate failed due to device plugin GetPreferredAllocation rpc failed with err: "
        "rpc error: code = ResourceExhausted desc = no single GPU fits, which is unexpected"
    )
    assert plugin.count("Allocate") == 0
    assert kubelet.allocated() == {("ns", "p", "c"): {}}


def test_a_removed_pods_devices_go_to_the_next_pod_at_once(kubelet, make_plugin):
    """Once a pod is gone its device IDs are offered to the very next admission (kubelet
    frees the devices of inactive pods before each allocation), whatever the plugin did
    meanwhile: here the plugin prefers them again and gets them."""
    plugin = make_plugin(n=4)
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)
    old = kubelet.admit_pod("ns", "old", [ContainerSpec("c", {RESOURCE: 2})])
    assert old.containers[0].device_ids == {RESOURCE: ["dev-2", "dev-3"]}
    kubelet.remove_pod("ns", "old")
    new = kubelet.admit_pod("ns", "new", [ContainerSpec("c", {RESOURCE: 2})])
    creq = plugin.requests("GetPreferredAllocation")[1].container_requests[0]
    assert list(creq.available_deviceIDs) == ["dev-0", "dev-1", "dev-2", "dev-3"]
    assert new.containers[0].device_ids == {RESOURCE: ["dev-2", "dev-3"]}


# ---------------------------------------------------------------- PodResources


def test_pod_resources_list_get_allocatable_and_remove(kubelet, make_plugin):
    plugin = make_plugin(n=3, numa={"dev-0": [0], "dev-1": [0], "dev-2": [1]})
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)
    assert kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 2})]).ok
    assert kubelet.admit_pod("other", "q", [ContainerSpec("x", {})]).ok

    listed = _pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    pods = {(p.namespace, p.name): p for p in listed.pod_resources}
    assert set(pods) == {("ns", "p"), ("other", "q")}
    [container] = pods["ns", "p"].containers
    assert container.name == "c"
    # kubelet sends one ContainerDevices per device, with its NUMA node.
    assert [
        (e.resource_name, list(e.device_ids), [n.ID for n in e.topology.nodes])
        for e in container.devices
    ] == [(RESOURCE, ["dev-1"], [0]), (RESOURCE, ["dev-2"], [1])]
    assert list(pods["other", "q"].containers[0].devices) == []

    got = _pod_resources(
        kubelet, "Get", pr.GetPodResourcesRequest(pod_name="p", pod_namespace="ns")
    )
    assert got.pod_resources == pods["ns", "p"]
    with pytest.raises(grpc.RpcError) as caught:
        _pod_resources(kubelet, "Get", pr.GetPodResourcesRequest(pod_name="p", pod_namespace="x"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    allocatable = _pod_resources(
        kubelet, "GetAllocatableResources", pr.AllocatableResourcesRequest()
    )
    assert _by_resource(allocatable.devices) == {RESOURCE: ["dev-0", "dev-1", "dev-2"]}

    kubelet.remove_pod("ns", "p")
    listed = _pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    assert [(p.namespace, p.name) for p in listed.pod_resources] == [("other", "q")]
    assert kubelet.admit_pod("ns", "p2", [ContainerSpec("c", {RESOURCE: 3})]).ok

    kubelet.set_pod_resources_available(False)
    with pytest.raises(grpc.RpcError) as caught:
        _pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    kubelet.set_pod_resources_available(True)
    _pod_resources(kubelet, "List", pr.ListPodResourcesRequest())


# ---------------------------------------------------------------- PreStartContainer


def test_pre_start_gets_the_container_device_ids(kubelet, make_plugin):
    with_pre_start = make_plugin(n=3, socket="a.sock", prefix="a", pre_start=True)
    with_pre_start.register(kubelet.kubelet_socket, resource="example.com/a")
    without = make_plugin(n=1, socket="b.sock", prefix="b")
    without.register(kubelet.kubelet_socket, resource="example.com/b")
    kubelet.wait_for_resource("example.com/a")
    kubelet.wait_for_resource("example.com/b")

    spec = ContainerSpec("c", {"example.com/a": 2, "example.com/b": 1})
    assert kubelet.admit_pod("ns", "p", [spec]).ok
    kubelet.start_container("ns", "p", "c")
    [request] = with_pre_start.requests("PreStartContainer")
    assert list(request.devices_ids) == ["a-1", "a-2"]
    assert without.count("PreStartContainer") == 0

    with_pre_start.pre_start_error = (grpc.StatusCode.FAILED_PRECONDITION, "card lost")
    with pytest.raises(PluginError) as caught:
        kubelet.start_container("ns", "p", "c")
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details == "card lost"


def test_pre_start_at_every_start_and_again_at_a_restart_without_allocate(kubelet, make_plugin):
    """PreStartContainer once per resource at each start of the container; a restart calls it
    again and never Allocate (kubelet reuses its checkpointed answers). After a kubelet
    restart, a resource whose plugin has not registered again is skipped (kubelet knows its
    endpoint from the checkpoint only, without options); a restart of a container that
    never started is a test error."""
    plugins = two_resources(kubelet, make_plugin, pre_start=True)
    assert kubelet.admit_pod("ns", "p", [ContainerSpec("c", BOTH)]).ok
    with pytest.raises(ValueError, match="never started"):
        kubelet.restart_container("ns", "p", "c")
    kubelet.start_container("ns", "p", "c")
    kubelet.restart_container("ns", "p", "c")
    for plugin in plugins.values():
        assert (plugin.count("PreStartContainer"), plugin.count("Allocate")) == (2, 1)
        ids = [list(r.devices_ids) for r in plugin.requests("PreStartContainer")]
        assert ids[0] == ids[1] == [f"{plugin.tag}-1"]

    kubelet.restart()
    kubelet.restart_container("ns", "p", "c")  # no plugin registered yet: no call, no error
    assert [p.count("PreStartContainer") for p in plugins.values()] == [2, 2]


# ---------------------------------------------------------------- restart


def test_restart_deletes_sockets_and_keeps_allocations(kubelet, make_plugin):
    plugin_dir = kubelet.device_plugin_dir
    plugin = make_plugin(n=2, socket="one.sock")
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)
    assert kubelet.admit_pod("ns", "p", [ContainerSpec("c", {RESOURCE: 1})]).ok
    for name in ("kubelet_internal_checkpoint", "junk"):
        with open(os.path.join(plugin_dir, name), "w") as f:
            f.write("{}")
    os.mkdir(os.path.join(plugin_dir, "subdir"))
    # A hard link outside the directory keeps the old inode alive, so a
    # recreated kubelet.sock cannot reuse its number.
    keep = os.path.join(os.path.dirname(plugin_dir), "old-kubelet.sock")
    os.link(kubelet.kubelet_socket, keep)
    old_inode = os.stat(keep).st_ino

    kubelet.restart()

    assert sorted(os.listdir(plugin_dir)) == [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
        "subdir",
    ]
    assert os.stat(kubelet.kubelet_socket).st_ino != old_inode  # recreated
    # Plugins and device lists are forgotten; the old stream is gone.
    assert kubelet.devices(RESOURCE) == []
    with pytest.raises(KeyError):
        kubelet.options(RESOURCE)
    deadline = time.monotonic() + 5
    while plugin.active_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert plugin.active_streams == 0
    # Running pods survive, in kubelet's record and in PodResources.
    assert kubelet.allocated() == {("ns", "p", "c"): {RESOURCE: ["dev-1"]}}
    listed = _pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    assert [p.name for p in listed.pod_resources] == ["p"]

    # The plugin serves a fresh socket and registers again.
    again = make_plugin(n=2, socket="two.sock")
    again.register(kubelet.kubelet_socket)
    kubelet.wait_for_resource(RESOURCE)
    result = kubelet.admit_pod("ns", "q", [ContainerSpec("c", {RESOURCE: 1})])
    assert result.containers[0].device_ids == {RESOURCE: ["dev-0"]}  # dev-1 is still held
    assert len(kubelet.registrations()) == 2


def test_node_capacity_is_zero_after_a_restart_until_the_next_status_update(workdir):
    """The node's capacity (all devices) and allocatable (healthy ones) are what the last node
    status update published. After a kubelet restart they are 0, and stay 0 once the plugin
    has registered again, until the next update; then the devices count again."""
    sim = TestKubelet(os.path.join(workdir, "dp"), os.path.join(workdir, "pr", "k.sock"),
                      status_update_seconds=None)  # fmt: skip
    sim.start()
    plugins = []
    try:
        assert sim.node_status() == {}
        plugins.append(FakePlugin(sim.device_plugin_dir, 3, socket="one.sock"))
        plugins[0].set_health("dev-2", "Unhealthy")
        plugins[0].register(sim.kubelet_socket)
        sim.wait_for_devices(RESOURCE, lambda ds: len(ds) == 3 and not ds[2].healthy)
        assert sim.node_status() == {}  # not published yet
        assert sim.update_node_status() == {RESOURCE: (3, 2)} == sim.node_status()

        sim.restart()
        assert sim.node_status() == {RESOURCE: (0, 0)}
        plugins.append(FakePlugin(sim.device_plugin_dir, 3, socket="two.sock"))
        plugins[1].register(sim.kubelet_socket)
        sim.wait_for_resource(RESOURCE)
        assert sim.node_status() == {RESOURCE: (0, 0)}  # until the next status update
        assert sim.update_node_status() == {RESOURCE: (3, 3)}
    finally:
        sim.stop()
        for plugin in plugins:
            plugin.stop()


def test_node_status_updates_run_on_their_own(workdir):
    """With status_update_seconds the updates run by themselves: a registered plugin's
    devices reach the node status without a call; stop ends the updater thread."""
    sim = TestKubelet(os.path.join(workdir, "dp"), os.path.join(workdir, "pr", "k.sock"),
                      status_update_seconds=0.05)  # fmt: skip
    sim.start()
    plugin = FakePlugin(sim.device_plugin_dir, 2)
    try:
        plugin.register(sim.kubelet_socket)
        deadline = time.monotonic() + 10
        while sim.node_status() != {RESOURCE: (2, 2)} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sim.node_status() == {RESOURCE: (2, 2)}
    finally:
        sim.stop()
        plugin.stop()
    assert _sim_threads() == []


def test_stop_is_idempotent_and_start_again_works(workdir):
    sim = TestKubelet(os.path.join(workdir, "dp"), os.path.join(workdir, "pr", "kubelet.sock"))
    sim.stop()  # never started: no-op
    sim.start()
    sim.stop()
    sim.stop()
    assert _sim_threads() == []
    sim.start()
    assert os.path.exists(sim.kubelet_socket)
    sim.stop()
    assert _sim_threads() == []
