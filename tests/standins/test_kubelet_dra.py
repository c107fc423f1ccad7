"""Tests of the test kubelet's DRA side (standins/kubelet_dra.py) against a fake DRA
plugin: a real gRPC server on unix sockets serving the registration API on a socket in
the plugins_registry directory and the DRA node API (v1 and/or v1beta1) on its
endpoint, with claims from the test API server (allocated as kube-scheduler would).

They pin kubelet's side as docs/dra.md describes it: discovery (only unix sockets, no
dot names, removal and re-creation), GetInfo's validation and the version choice,
NotifyRegistrationStatus, retries, the newest connected instance, slice wiping, the
batching and error rules of NodePrepareResources/NodeUnprepareResources, shared claims,
kubelet restarts, PodResources' dynamic_resources and the CDI ids a container gets.

Unix socket paths must stay under 108 bytes: every test works in a short directory
from ``tempfile.mkdtemp`` under /tmp.

Why this module is longer than 400 lines: it holds the DRA stand-in to kubelet's
behaviour call by call, as the stand-in itself is large.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from concurrent import futures

import grpc
import pytest

from nodemgr.kubelet.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from nodemgr.kubelet.api import pluginregistration_v1_pb2 as reg
from nodemgr.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from nodemgr.kubelet.api import podresources_v1_pb2 as pr
from nodemgr.kubelet.api import podresources_v1_pb2_grpc as pr_grpc
from standins import kubelet_dra
from standins.apiserver_sim import TestApiServer
from standins.kubelet_dra import THREAD_PREFIX, V1, V1BETA1, ApiAccess, DraKubelet
from standins.kubelet_sim import TestKubelet

DRIVER = "gpushare.aliyun.com"
NODE = "node-a"


class FakeDraPlugin:
    """A DRA kubelet plugin: Registration on ``<registry>/<name>-reg.sock``, DRAPlugin
    (the services in ``serve``) on ``<dir>/<name>.sock``.

    Prepare answers, per claim, one device per allocation result of this driver with
    CDI id ``<driver>/gpu=<claim uid>-<device>`` (and the share ID in v1); ``answer``
    replaces that (a function of the request returning the response, or raising an
    RpcError through ``context``). Every call and notification is recorded.
    """

    def __init__(self, workdir, registry, name=DRIVER, *, versions=(V1,), info_type="DRAPlugin",
                 endpoint=None, serve=(V1, V1BETA1), api=None, socket_name=None,
                 info_delay=0.0):  # fmt: skip
        self.name, self.api, self.info_delay = name, api, info_delay
        base = socket_name or name
        self.registration_socket = os.path.join(registry, f"{base}-reg.sock")
        self.endpoint = endpoint if endpoint is not None else os.path.join(workdir, f"{base}.sock")
        self.info = reg.PluginInfo(type=info_type, name=name, endpoint=self.endpoint,
                                   supported_versions=list(versions))  # fmt: skip
        self.calls: list[tuple[str, str, object]] = []  # (service, method, request)
        self.notifications: list[tuple[bool, str]] = []
        self.answer = None
        self.lock = threading.Lock()
        self.servers = []
        self._serve_dra(serve)
        self._serve_registration()

    def _server(self):
        server = grpc.server(futures.ThreadPoolExecutor(4, thread_name_prefix="fake-dra"))
        self.servers.append(server)
        return server

    def _serve_dra(self, serve):
        if not serve or self.endpoint == "":
            self._dra_services = serve
            return
        server = self._server()
        self._add_dra(server, serve)
        server.add_insecure_port("unix://" + self.endpoint)
        server.start()

    def _add_dra(self, server, serve):
        plugin = self
        for service in serve:
            pb, pb_grpc = (dra_v1_pb2, dra_v1_pb2_grpc) if service == V1 else (
                dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)  # fmt: skip

            class Servicer(pb_grpc.DRAPluginServicer):
                def NodePrepareResources(self, request, context, pb=pb, service=service):  # noqa: N802
                    return plugin._prepare(service, pb, request, context)

                def NodeUnprepareResources(self, request, context, pb=pb, service=service):  # noqa: N802
                    plugin._record(service, "NodeUnprepareResources", request)
                    if plugin.answer is not None:
                        return plugin.answer("NodeUnprepareResources", request, context)
                    response = pb.NodeUnprepareResourcesResponse()
                    for claim in request.claims:
                        response.claims[claim.uid].SetInParent()
                    return response

            pb_grpc.add_DRAPluginServicer_to_server(Servicer(), server)

    def _serve_registration(self):
        plugin = self

        class Registration(reg_grpc.RegistrationServicer):
            def GetInfo(self, request, context):  # noqa: N802
                time.sleep(plugin.info_delay)
                return plugin.info

            def NotifyRegistrationStatus(self, request, context):  # noqa: N802
                with plugin.lock:
                    plugin.notifications.append((request.plugin_registered, request.error))
                return reg.RegistrationStatusResponse()

        server = self._server()
        reg_grpc.add_RegistrationServicer_to_server(Registration(), server)
        if self.endpoint == "":  # the DRA service on the registration socket
            self._add_dra(server, self._dra_services)
        server.add_insecure_port("unix://" + self.registration_socket)
        server.start()

    def _record(self, service, method, request):
        with self.lock:
            self.calls.append((service, method, request))

    def _prepare(self, service, pb, request, context):
        self._record(service, "NodePrepareResources", request)
        if self.answer is not None:
            return self.answer("NodePrepareResources", request, context)
        response = pb.NodePrepareResourcesResponse()
        for claim in request.claims:
            entry = response.claims[claim.uid]
            entry.SetInParent()
            stored = self.api.resource_claim(claim.namespace, claim.name)
            for result in stored["status"]["allocation"]["devices"]["results"]:
                if result["driver"] != self.name:
                    continue
                device = entry.devices.add(
                    request_names=[result["request"]], pool_name=result["pool"],
                    device_name=result["device"],
                    cdi_device_ids=[f"{self.name}/gpu={claim.uid}-{result['device']}"],
                )  # fmt: skip
                if service == V1 and result.get("shareID"):
                    device.share_id = result["shareID"]
        return response

    def methods(self, method=None):
        with self.lock:
            return [(s, m, r) for s, m, r in self.calls if method in (None, m)]

    def stop(self, remove_socket=True):
        for server in self.servers:
            server.stop(None).wait()
        if remove_socket:
            for path in (self.registration_socket, self.endpoint):
                if path and os.path.exists(path):
                    os.unlink(path)


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="kd", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def api():
    server = TestApiServer()
    server.start()
    yield server
    server.stop()


def gpu_slice(devices=("gpu-0", "gpu-1"), driver=DRIVER) -> dict:
    policy = {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}
    return {"metadata": {"name": f"{NODE}-{driver}"}, "spec": {
        "driver": driver, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
        "nodeName": NODE, "devices": [
            {"name": d, "allowMultipleAllocations": True,
             "capacity": {"memory": {"value": "16Gi", "requestPolicy": policy}}}
            for d in devices]}}  # fmt: skip


class Env:
    """A DRA kubelet on ``<workdir>/registry`` with the test API server, and plugins."""

    def __init__(self, workdir, api, **kwargs):
        self.workdir, self.api = workdir, api
        self.registry = os.path.join(workdir, "registry")
        os.makedirs(self.registry)
        self.access = ApiAccess(api.url, api.token)
        self.kubelet = DraKubelet(self.registry, self.access, NODE, poll_interval=0.05, **kwargs)
        self.plugins = []
        api.add_device_class(DRIVER, [f'device.driver == "{DRIVER}"'])

    def plugin(self, name=DRIVER, **kwargs) -> FakeDraPlugin:
        plugin = FakeDraPlugin(self.workdir, self.registry, name, api=self.api, **kwargs)
        self.plugins.append(plugin)
        return plugin

    def claimed_pod(self, pod_name, claims, containers=None, driver=DRIVER, memory="2Gi"):
        """A pod and its claims (created unless they exist), allocated and reserved."""
        for claim in claims:
            if self.api.resource_claim("ns", claim) is None:
                self.api.add_resource_claim("ns", claim, [
                    {"name": "gpu", "deviceClassName": driver,
                     "capacity": {"memory": memory}}])  # fmt: skip
        containers = containers or [{"name": "main", "claims": [{"name": c} for c in claims]}]
        pod = self.api.add_pod("ns", pod_name, NODE, containers=containers,
                               resource_claims=[{"name": c, "resourceClaimName": c}
                                                for c in claims])  # fmt: skip
        for claim in claims:
            if (self.api.resource_claim("ns", claim).get("status") or {}).get("allocation"):
                self.api.reserve_claim("ns", claim, pod)
            else:
                self.api.allocate_claim("ns", claim, NODE, pod)
        return pod

    def close(self):
        self.kubelet.stop()
        for plugin in self.plugins:
            plugin.stop()


@pytest.fixture
def env(workdir, api):
    env = Env(workdir, api)
    env.kubelet.start()  # it wipes the node's slices: the driver publishes after
    api.add_resource_slice(gpu_slice())
    yield env
    env.close()


def wait(predicate, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ------------------------------------------------------------------ registration


def test_a_plugin_registers_and_is_told_so(env):
    """GetInfo, validation, NotifyRegistrationStatus(true); v1 chosen from
    [v1, v1beta1]; the endpoint is dialled and its connection followed."""
    plugin = env.plugin(versions=(V1, V1BETA1))
    env.kubelet.wait_registered(DRIVER)
    wait(lambda: env.kubelet.registrations()[0].notified, "the notification")
    assert plugin.notifications == [(True, "")]
    [record] = env.kubelet.registrations()
    assert (record.socket, record.error, record.service) == (plugin.registration_socket, None, V1)
    assert record.info.name == DRIVER and record.notified
    assert env.kubelet.plugins(DRIVER) == [(plugin.endpoint, V1, True)]


def test_the_first_version_of_the_plugins_list_that_kubelet_knows_wins(env, api):
    """[v1beta1, v1] picks v1beta1: calls go to the v1beta1 service, whose Device has no
    share_id; an endpoint left empty is the registration socket itself."""
    plugin = env.plugin(versions=("v9.DRAPlugin", V1BETA1, V1), endpoint="")
    env.kubelet.wait_registered(DRIVER)
    assert env.kubelet.plugins(DRIVER) == [(plugin.registration_socket, V1BETA1, True)]
    pod = env.claimed_pod("p", ["c"])
    assert env.kubelet.prepare_pod(pod).ok
    [(service, _, request)] = plugin.methods("NodePrepareResources")
    assert service == V1BETA1 and isinstance(request, dra_v1beta1_pb2.NodePrepareResourcesRequest)
    [device] = env.kubelet.claims()[("ns", "c")].drivers[DRIVER]
    assert device.share_id is None


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"info_type": "CSIPlugin"}, "no handler registered for plugin type: CSIPlugin"),
        ({"versions": ()}, "empty list of supported gRPC services"),
        ({"versions": ("v1alpha3.NodeService",)}, "none of services supported by the plugin"),
        ({"name": ""}, "empty driver name"),
    ],
)
def test_refused_registrations_are_notified_and_retried(env, kwargs, words):
    """An unknown type, no or no known version, no name: refused, told so with the
    reason, and tried again (a growing delay) while the socket is there."""
    plugin = env.plugin(**kwargs)
    wait(lambda: len(plugin.notifications) >= 2, "two refusals")
    assert all(not ok and words in error for ok, error in plugin.notifications)
    assert env.kubelet.plugins(kwargs.get("name", DRIVER)) == []
    first, second = env.kubelet.registrations()[:2]
    assert second.time - first.time >= kubelet_dra.RETRY_INITIAL_S * 0.9


def test_only_unix_sockets_without_a_dot_name_count(env, workdir):
    """A regular file, a socket named .hidden-reg.sock: never dialled; a socket in a
    subdirectory: registered."""
    with open(os.path.join(env.registry, "notes-reg.sock"), "w") as f:
        f.write("x")
    hidden = socket.socket(socket.AF_UNIX)
    hidden.bind(os.path.join(env.registry, ".hidden-reg.sock"))
    os.makedirs(os.path.join(env.registry, "sub"))
    plugin = FakeDraPlugin(workdir, os.path.join(env.registry, "sub"), api=env.api)
    env.plugins.append(plugin)
    env.kubelet.wait_registered(DRIVER)
    time.sleep(0.3)
    assert [r.socket for r in env.kubelet.registrations()] == [plugin.registration_socket]
    hidden.close()


def test_a_removed_socket_deregisters_and_a_new_one_registers_again(env):
    """Socket gone: the driver is gone. A plugin restart (a new socket at the same
    path): registered again, GetInfo asked again."""
    plugin = env.plugin()
    env.kubelet.wait_registered(DRIVER)
    plugin.stop()
    wait(lambda: env.kubelet.plugins(DRIVER) == [], "deregistration")
    env.plugins.remove(plugin)
    again = env.plugin()
    env.kubelet.wait_registered(DRIVER)
    assert len(env.kubelet.registrations()) == 2
    assert env.kubelet.plugins(DRIVER) == [(again.endpoint, V1, True)]


def test_a_slow_get_info_is_refused_then_retried(env):
    """GetInfo has 1 s: a plugin answering in 1.5 s is not registered (no notification:
    kubelet gave up before any verdict); once it answers at once, it is."""
    plugin = env.plugin(info_delay=1.5)
    wait(lambda: env.kubelet.registrations() and env.kubelet.registrations()[0].error, "refusal", 5)
    first = env.kubelet.registrations()[0]
    assert "DeadlineExceeded" in first.error and not first.notified
    plugin.info_delay = 0
    env.kubelet.wait_registered(DRIVER, timeout=10)


def test_an_endpoint_registered_twice_is_refused(env, workdir):
    """A second instance naming the endpoint of the first: refused and told so; the
    first stays."""
    first = env.plugin()
    env.kubelet.wait_registered(DRIVER)
    second = env.plugin(endpoint=first.endpoint, serve=(), socket_name="copy")
    wait(lambda: second.notifications, "the refusal")
    assert second.notifications[0][0] is False
    assert "already registered for DRA driver plugin" in second.notifications[0][1]
    assert env.kubelet.plugins(DRIVER) == [(first.endpoint, V1, True)]


def test_calls_go_to_the_newest_connected_instance(env):
    """Two instances (rolling update): calls go to the newer; when its DRA service stops
    (its registration socket still there, the connection down), to the older one."""
    old = env.plugin(socket_name="old")
    env.kubelet.wait_registered(DRIVER)
    new = env.plugin(socket_name="new")
    wait(lambda: len(env.kubelet.plugins(DRIVER)) == 2 and all(
        c for _, _, c in env.kubelet.plugins(DRIVER)), "both connected")  # fmt: skip
    assert env.kubelet.prepare_pod(env.claimed_pod("p1", ["c1"])).ok
    assert len(new.methods()) == 1 and old.methods() == []
    new.servers[0].stop(None).wait()  # its DRA service only: registration socket stays
    wait(lambda: not env.kubelet.plugins(DRIVER)[1][2], "the newer to be disconnected")
    assert env.kubelet.prepare_pod(env.claimed_pod("p2", ["c2"])).ok
    assert len(old.methods()) == 1


def test_slices_are_wiped_at_start_and_after_the_driver_is_gone(workdir, api):
    """At start the node's slices go (another node's stay); a driver whose last instance
    disconnected loses its slices after the wiping delay, unless it is back in time."""
    api.add_resource_slice(gpu_slice())
    other = gpu_slice()
    other["metadata"]["name"] = "elsewhere"
    other["spec"] |= {"nodeName": "node-b", "pool": {"name": "node-b", "generation": 1,
                                                     "resourceSliceCount": 1}}  # fmt: skip
    api.add_resource_slice(other)
    delay = 2.0
    env = Env(workdir, api, wiping_delay=delay)
    try:
        env.kubelet.start()
        assert [s["spec"]["nodeName"] for s in api.resource_slices()] == ["node-b"]
        plugin = env.plugin()
        env.kubelet.wait_registered(DRIVER)
        api.add_resource_slice(gpu_slice())  # the driver republishes
        plugin.stop()
        stopped = time.monotonic()
        env.plugins.remove(plugin)
        back = env.plugin()  # back within the delay: nothing wiped
        wait(lambda: len(env.kubelet.registrations()) == 2, "the second registration")
        env.kubelet.wait_registered(DRIVER)
        time.sleep(max(0.0, stopped + delay + 0.5 - time.monotonic()))
        assert len(api.resource_slices(NODE)) == 1
        back.stop()
        wait(lambda: api.resource_slices(NODE) == [], "the wipe", delay + 5)
        assert len(api.resource_slices("node-b")) == 1
    finally:
        env.close()


# ------------------------------------------------------------------ prepare / unprepare


def test_one_call_per_driver_with_the_pods_unprepared_claims(env, api):
    """A pod with two claims of one driver: one NodePrepareResources with both; a
    second pod sharing one of them and bringing a new one: only the new one is asked
    for; the claim is unprepared after its last pod, in one call per driver."""
    plugin = env.plugin()
    env.kubelet.wait_registered(DRIVER)
    first = env.claimed_pod("p1", ["a", "b"])
    assert env.kubelet.prepare_pod(first).ok
    second = env.claimed_pod("p2", ["b", "c"])
    assert env.kubelet.prepare_pod(second).ok
    prepared = [[c.name for c in r.claims] for _, _, r in plugin.methods("NodePrepareResources")]
    assert prepared == [["a", "b"], ["c"]]
    [(_, _, request)] = plugin.methods("NodePrepareResources")[:1]
    claim_b = api.resource_claim("ns", "b")
    assert (request.claims[1].namespace, request.claims[1].uid) == (
        "ns",
        claim_b["metadata"]["uid"],
    )
    assert env.kubelet.remove_pod(first).ok
    unprepared = [
        [c.name for c in r.claims] for _, _, r in plugin.methods("NodeUnprepareResources")
    ]
    assert unprepared == [["a"]]  # b is still used by p2
    assert env.kubelet.remove_pod(second).ok
    unprepared = [
        [c.name for c in r.claims] for _, _, r in plugin.methods("NodeUnprepareResources")
    ]
    assert unprepared == [["a"], ["b", "c"]]
    assert env.kubelet.claims() == {}


@pytest.mark.parametrize("case", ["not allocated", "not reserved", "driver not registered",
                                  "claim missing"])  # fmt: skip
def test_a_pod_that_cannot_be_prepared_makes_no_call(env, api, case):
    """A claim not allocated (so reserving nobody), not reserving the pod, allocated to a
    driver that is not registered, or not there at all: the pod start fails with
    kubelet's words, and the plugin is never called."""
    plugin = env.plugin()
    env.kubelet.wait_registered(DRIVER)
    if case == "not allocated":
        api.add_resource_claim("ns", "c", [{"name": "gpu", "deviceClassName": DRIVER}])
        pod = api.add_pod(
            "ns", "p", NODE, resource_claims=[{"name": "c", "resourceClaimName": "c"}]
        )
        words = "is not allowed to use ResourceClaim c"  # reservedFor is checked first
    elif case == "not reserved":
        env.claimed_pod("other", ["c"])
        pod = api.add_pod(
            "ns", "p", NODE, resource_claims=[{"name": "c", "resourceClaimName": "c"}]
        )
        words = "is not allowed to use ResourceClaim c"
    elif case == "driver not registered":
        api.add_device_class("other.example.com", ['device.driver == "other.example.com"'])
        api.add_resource_slice(gpu_slice(driver="other.example.com"))
        pod = env.claimed_pod("p", ["c"], driver="other.example.com")
        words = "DRA driver other.example.com is not registered"
    else:
        pod = api.add_pod(
            "ns", "p", NODE, resource_claims=[{"name": "c", "resourceClaimName": "c"}]
        )
        words = 'fetch ResourceClaim c: resourceclaims.resource.k8s.io "c" not found'
    result = env.kubelet.prepare_pod(pod)
    assert not result.ok and words in result.error, result.error
    assert plugin.methods() == []


def test_a_template_claim_must_be_owned_by_the_pod(env, api):
    """A claim from a template (named in status.resourceClaimStatuses) that the pod
    does not own is refused; one it owns is prepared; a missing status entry fails."""
    env.plugin()
    env.kubelet.wait_registered(DRIVER)
    claims = [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    waiting = api.add_pod("ns", "w", NODE, resource_claims=claims)
    assert "ResourceClaim not created yet" in env.kubelet.prepare_pod(waiting).error
    generated = [{"name": "gpu", "resourceClaimName": "p-gpu"}]
    pod = api.add_pod("ns", "p", NODE, resource_claims=claims, resource_claim_statuses=generated)
    request = [{"name": "gpu", "deviceClassName": DRIVER}]
    api.add_resource_claim("ns", "p-gpu", request)
    api.allocate_claim("ns", "p-gpu", NODE, pod)
    assert "(pod is not owner)" in env.kubelet.prepare_pod(pod).error
    api.delete_resource_claim("ns", "p-gpu")
    api.add_resource_claim("ns", "p-gpu", request, owner=pod)
    api.allocate_claim("ns", "p-gpu", NODE, pod)
    assert env.kubelet.prepare_pod(pod).ok


def failing(kind):
    def answer(method, request, context):
        if kind == "grpc":
            context.abort(grpc.StatusCode.UNAVAILABLE, "driver busy")
        response = (dra_v1_pb2.NodePrepareResourcesResponse() if method == "NodePrepareResources"
                    else dra_v1_pb2.NodeUnprepareResourcesResponse())  # fmt: skip
        uids = [c.uid for c in request.claims]
        if kind == "claim error":
            response.claims[uids[0]].error = "card 0 is broken"
        elif kind == "unknown uid":
            response.claims["not-asked"].SetInParent()
        for uid in uids[1:] if kind in ("skip", "claim error") else uids:
            response.claims[uid].SetInParent()
            if method == "NodePrepareResources":
                response.claims[uid].devices.add(pool_name=NODE, device_name="gpu-1")
        return response

    return answer


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("grpc", "NodePrepareResources: rpc error: code = Unavailable desc = driver busy"),
        ("claim error", "NodePrepareResources failed for ResourceClaim a: card 0 is broken"),
        ("skip", "NodePrepareResources skipped 1 ResourceClaims"),
        ("unknown uid", "NodePrepareResources returned result for unknown claim UID not-asked"),
    ],
)
def test_a_failed_prepare_fails_the_pod_and_is_asked_again(env, kind, words):
    """A gRPC error, a per-claim error, a claim left out, an unknown UID: the pod start
    fails with kubelet's message, no claim counts as prepared, and the next try asks for
    every claim again (a device answered in the failed try is recorded twice, as kubelet
    does)."""
    plugin = env.plugin()
    env.kubelet.wait_registered(DRIVER)
    pod = env.claimed_pod("p", ["a", "b"])
    plugin.answer = failing(kind)
    result = env.kubelet.prepare_pod(pod)
    assert result.error == "prepare dynamic resources: " + words
    assert not any(info.prepared for info in env.kubelet.claims().values())
    plugin.answer = None
    assert env.kubelet.prepare_pod(pod).ok
    asked = [[c.name for c in r.claims] for _, _, r in plugin.methods("NodePrepareResources")]
    assert asked == [["a", "b"], ["a", "b"]]
    assert env.kubelet.calls()[0].error == words
    if kind == "skip":  # kubelet's quirk: b's device, kept from the failed try, again
        assert len(env.kubelet.claims()[("ns", "b")].drivers[DRIVER]) == 2


def test_a_failed_unprepare_is_retried_by_the_reconcile_loop(env):
    """A per-claim unprepare error keeps the claim recorded; reconcile() unprepares the
    claims of pods no longer active until the plugin succeeds."""
    plugin = env.plugin()
    env.kubelet.wait_registered(DRIVER)
    pod = env.claimed_pod("p", ["a"])
    assert env.kubelet.prepare_pod(pod).ok
    plugin.answer = failing("claim error")
    result = env.kubelet.remove_pod(pod)
    assert "NodeUnprepareResources failed for ResourceClaim a: card 0 is broken" in result.error
    assert ("ns", "a") in env.kubelet.claims()
    plugin.answer = None
    assert [r.ok for r in env.kubelet.reconcile()] == [True]
    assert env.kubelet.claims() == {}


def test_each_call_has_a_deadline(env, monkeypatch):
    """A plugin slower than the deadline (45 s; shortened here): DeadlineExceeded."""
    monkeypatch.setattr(kubelet_dra, "CALL_TIMEOUT_S", 0.3)
    plugin = env.plugin()
    env.kubelet.wait_registered(DRIVER)
    release = threading.Event()
    plugin.answer = lambda method, request, context: release.wait(5) and None
    try:
        result = env.kubelet.prepare_pod(env.claimed_pod("p", ["a"]))
    finally:
        release.set()
    assert "rpc error: code = DeadlineExceeded" in result.error


def test_a_kubelet_restart_registers_again_and_prepares_again(env):
    """After a restart: the plugin registers again from the scan (GetInfo again); the
    running pod's claims count as not prepared, so its next prepare calls the plugin
    again (prepare must be idempotent)."""
    plugin = env.plugin()
    env.kubelet.wait_registered(DRIVER)
    pod = env.claimed_pod("p", ["a"])
    assert env.kubelet.prepare_pod(pod).ok
    assert env.kubelet.prepare_pod(pod).ok  # prepared: no second call
    assert len(plugin.methods("NodePrepareResources")) == 1
    env.kubelet.restart()
    env.kubelet.wait_registered(DRIVER)
    assert len(env.kubelet.registrations()) == 2
    assert env.kubelet.prepare_pod(pod).ok
    assert len(plugin.methods("NodePrepareResources")) == 2


# ------------------------------------------------------------------ PodResources, CDI


def test_pod_resources_list_the_claims_of_each_container(workdir, api):
    """Through the test kubelet's PodResources server: a DRA pod is listed with every
    container; a container naming a claim gets claim name and namespace and, per
    device, its CDI ids, driver, pool, device and share ID (kubelet's quirk: a driver's
    second device repeats the first's CDI id); a container naming none gets none."""
    env = Env(workdir, api)
    kubelet = TestKubelet(os.path.join(workdir, "dp"), os.path.join(workdir, "pr", "kubelet.sock"))
    kubelet.start()
    try:
        env.kubelet.start()
        api.add_resource_slice(gpu_slice())
        kubelet.attach_dra(env.kubelet)
        env.plugin()
        env.kubelet.wait_registered(DRIVER)
        request = {"name": "gpu", "deviceClassName": DRIVER, "count": 2,
                   "capacity": {"memory": "1Gi"}}  # fmt: skip
        api.add_resource_claim("ns", "two", [request])
        containers = [{"name": "main", "claims": [{"name": "two"}]}, {"name": "side"}]
        pod = env.claimed_pod("p", ["two"], containers=containers)
        assert env.kubelet.prepare_pod(pod).ok
        with grpc.insecure_channel("unix://" + kubelet.pod_resources_socket) as channel:
            listed = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest())
            got = pr_grpc.PodResourcesListerStub(channel).Get(
                pr.GetPodResourcesRequest(pod_name="p", pod_namespace="ns")
            )
        [entry] = listed.pod_resources
        assert entry == got.pod_resources
        main, side = entry.containers
        assert (main.name, side.name, list(side.dynamic_resources)) == ("main", "side", [])
        [dynamic] = main.dynamic_resources
        claim = api.resource_claim("ns", "two")
        uid = claim["metadata"]["uid"]
        shares = [r["shareID"] for r in claim["status"]["allocation"]["devices"]["results"]]
        assert (dynamic.claim_name, dynamic.claim_namespace) == ("two", "ns")
        got_resources = [
            ([c.name for c in r.cdi_devices], r.driver_name, r.pool_name, r.device_name, r.share_id)
            for r in dynamic.claim_resources
        ]
        first, second = f"{DRIVER}/gpu={uid}-gpu-0", f"{DRIVER}/gpu={uid}-gpu-1"
        assert got_resources == [
            ([first], DRIVER, NODE, "gpu-0", shares[0]),
            ([first, second], DRIVER, NODE, "gpu-1", shares[1]),
        ]
        env.kubelet.remove_pod(pod)
        with grpc.insecure_channel("unix://" + kubelet.pod_resources_socket) as channel:
            listed = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest())
        assert list(listed.pod_resources) == []
    finally:
        kubelet.stop()
        env.close()


def test_cdi_devices_follow_the_containers_request(env, api):
    """A container naming a claim's request gets the CDI ids of the devices prepared for
    that request; one naming the claim without a request gets all of them."""
    env.plugin()
    env.kubelet.wait_registered(DRIVER)
    api.add_resource_claim("ns", "c", [
        {"name": "a", "deviceClassName": DRIVER, "capacity": {"memory": "1Gi"}},
        {"name": "b", "deviceClassName": DRIVER, "capacity": {"memory": "1Gi"}}])  # fmt: skip
    containers = [{"name": "one", "claims": [{"name": "c", "request": "b"}]},
                  {"name": "all", "claims": [{"name": "c"}]}]  # fmt: skip
    pod = env.claimed_pod("p", ["c"], containers=containers)
    assert env.kubelet.prepare_pod(pod).ok
    uid = api.resource_claim("ns", "c")["metadata"]["uid"]
    results = api.resource_claim("ns", "c")["status"]["allocation"]["devices"]["results"]
    by_request = {r["request"]: f"{DRIVER}/gpu={uid}-{r['device']}" for r in results}
    assert env.kubelet.cdi_devices(pod, "one") == [by_request["b"]]
    assert env.kubelet.cdi_devices(pod, "all") == [by_request["a"], by_request["b"]]


def test_stop_joins_every_thread(workdir, api):
    """After stop() no thread of the DRA kubelet is left, even with a registration
    waiting on a socket nobody serves."""
    env = Env(workdir, api)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(os.path.join(env.registry, "dead-reg.sock"))  # bound, never listening
    env.kubelet.start()
    wait(lambda: env.kubelet.registrations(), "the dial")
    env.kubelet.stop()
    assert [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)] == []
    dead.close()
