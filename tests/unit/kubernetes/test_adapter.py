"""The Kubernetes adapter (nodemgr.kubernetes.adapter, client, podwatch, writes).

Without an API server, it pins: a pod from the API as PodInfo (raw JSON and
V1Pod; extended resources only, a limit standing in for a missing request,
whole-number quantities), where credentials come from and the one error
naming everything tried, ApiClients that leave the client's global
configuration alone, the mapping of client errors to the KubeApiError
classes, API_PERMISSIONS, the coalescing write queue and its backoff, and
the event rate limit.

Against the test API server (tests/harness/apiserver_sim.py: the real REST and
watch protocol, so the kubernetes client runs end to end), it pins: the
cache fills from one LIST (field selector spec.nodeName) and follows
ADDED/MODIFIED/DELETED of this node's pods only; a clean watch end resumes
without a LIST, an expired one (410) lists again; after the server stops and
restarts the watch reconnects and the writes made meanwhile arrive in their
latest coalesced form, in one request; 5xx/429 and a timed-out request are
retried; 404 drops a write, 403 drops it with one log line naming the RBAC;
node labels: foreign ones untouched, our stale ones removed; gpu-count in
status capacity and allocatable; events rate-limited, the suppressed ones
folded into the next one's count; the Allocate path's calls return in well
under 50 ms while the server hangs or is down; stop() is prompt (also with a
hung server); without credentials, one log line and nothing else;
``enabled: false``, nothing at all.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest
import urllib3
from kubernetes.client import Configuration, V1Pod
from kubernetes.client.exceptions import ApiException

from nodemgr.config.schema import KubernetesSettings
from nodemgr.domain.podmatch import ContainerRequest
from nodemgr.errors import (
    KubeApiError,
    KubeConflict,
    KubeCredentialsError,
    KubeExpired,
    KubeForbidden,
    KubeNotFound,
    KubeUnavailable,
)
from nodemgr.kubernetes.adapter import API_PERMISSIONS, KubeAdapter
from nodemgr.kubernetes.client import find_credentials, map_error, new_api_client, rfc3339
from nodemgr.kubernetes.podwatch import extended_requests, is_extended_resource, pod_info
from nodemgr.kubernetes.writes import EventLimiter, WriteQueue, merge_keys, replace
from tests.harness.apiserver_sim import TestApiServer

MEM = "aliyun.com/gpu-mem"
CORE = "aliyun.com/gpu-core.percentage"


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def raw_pod(**overrides):
    pod = {
        "metadata": {
            "name": "train-0",
            "namespace": "ml",
            "uid": "uid-1",
            "resourceVersion": "42",
            "creationTimestamp": "2024-01-02T03:04:05Z",
            "annotations": {"ALIYUN_COM_GPU_MEM_IDX": "1"},
        },
        "spec": {
            "nodeName": "node-a",
            "initContainers": [
                {"name": "fetch", "resources": {"limits": {MEM: "1"}}},
            ],
            "containers": [
                {
                    "name": "main",
                    "resources": {
                        "requests": {MEM: "4", CORE: "30", "cpu": "500m", "memory": "1Gi"},
                        "limits": {MEM: "4", CORE: "30", "nvidia.com/gpu": "1"},
                    },
                },
                {"name": "sidecar"},
            ],
        },
        "status": {"phase": "Pending"},
    }
    pod.update(overrides)
    return pod


# --- pods ------------------------------------------------------------------


def test_pod_info_from_raw_json():
    info = pod_info(raw_pod())
    assert (info.namespace, info.name, info.uid, info.node_name) == (
        "ml",
        "train-0",
        "uid-1",
        "node-a",
    )
    assert info.phase == "Pending"
    assert info.created_at == 1704164645.0  # 2024-01-02T03:04:05Z
    assert info.deleting is False
    assert info.annotations == {"ALIYUN_COM_GPU_MEM_IDX": "1"}
    assert info.resource_version == "42"
    assert info.containers == (
        # cpu/memory are not extended resources; the limit of nvidia.com/gpu stands for its request
        ContainerRequest("main", {MEM: 4, CORE: 30, "nvidia.com/gpu": 1}),
        ContainerRequest("sidecar", {}),
    )
    assert info.init_containers == (ContainerRequest("fetch", {MEM: 1}),)


def test_pod_info_from_v1pod_equals_raw():
    assert pod_info(V1Pod.from_dict(raw_pod())) == pod_info(raw_pod())


def test_pod_info_deleting_and_defaults():
    pod = raw_pod()
    pod["metadata"]["deletionTimestamp"] = "2024-01-02T03:05:00Z"
    del pod["status"]
    info = pod_info(pod)
    assert info.deleting is True
    assert info.phase == "Pending"  # no status yet
    bare = pod_info({"metadata": {"name": "x", "namespace": "y"}})
    assert (bare.created_at, bare.containers, bare.annotations, bare.uid) == (0.0, (), {}, "")


@pytest.mark.parametrize(
    ("name", "extended"),
    [
        (MEM, True),
        ("nvidia.com/gpu", True),
        ("cpu", False),
        ("hugepages-2Mi", False),
        ("kubernetes.io/something", False),
        ("foo.kubernetes.io/bar", False),
        ("requests.aliyun.com/gpu-mem", False),
    ],
)
def test_is_extended_resource(name, extended):
    assert is_extended_resource(name) is extended


def test_extended_requests_quantities():
    resources = {
        "requests": {MEM: "2", "example.com/big": "1k", "example.com/half": "500m"},
        "limits": {MEM: "3", "example.com/only-limit": "7", "example.com/bad": "lots"},
    }
    # The request wins over the limit; "1k" is 1000; a fraction or garbage is no request.
    assert extended_requests(resources) == {
        MEM: 2,
        "example.com/big": 1000,
        "example.com/only-limit": 7,
    }
    assert extended_requests(None) == {}


def test_rfc3339():
    assert rfc3339(1704164645.7) == "2024-01-02T03:04:05Z"


# --- credentials ---------------------------------------------------------------


KUBECONFIG_TEXT = """\
apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "http://127.0.0.1:1"}
users:
- name: u
  user: {token: secret-token}
contexts:
- name: ctx
  context: {cluster: c, user: u}
current-context: ctx
"""


@pytest.fixture
def kubeconfig(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG_TEXT)
    return str(path)


def test_credentials_named_file(kubeconfig, tmp_path):
    creds = find_credentials(kubeconfig, environ={}, home=str(tmp_path))
    assert (creds.kind, creds.path, creds.source) == (
        "kubeconfig",
        kubeconfig,
        "kubernetes.kubeconfig",
    )


def test_credentials_named_file_missing_has_no_fallback(kubeconfig, tmp_path):
    with pytest.raises(KubeCredentialsError) as caught:
        find_credentials(
            str(tmp_path / "nope"), environ={"KUBECONFIG": kubeconfig}, home=str(tmp_path)
        )
    assert "kubernetes.kubeconfig" in str(caught.value) and "no such file" in str(caught.value)


def test_credentials_from_env_list(kubeconfig, tmp_path):
    value = f"{tmp_path}/missing:{kubeconfig}"
    creds = find_credentials("", environ={"KUBECONFIG": value}, home=str(tmp_path))
    assert (creds.kind, creds.path, creds.source) == ("kubeconfig", value, "$KUBECONFIG")


def test_credentials_in_cluster_then_home(kubeconfig, tmp_path):
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t")
    environ = {"KUBECONFIG": str(tmp_path / "missing"), "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    creds = find_credentials("", environ, home=str(tmp_path), service_account_dir=str(sa))
    assert (creds.kind, creds.path) == ("in-cluster", str(sa))

    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text(KUBECONFIG_TEXT)
    creds = find_credentials("", {}, home=str(home), service_account_dir=str(sa))
    assert (creds.source, creds.path) == ("~/.kube/config", str(home / ".kube" / "config"))


def test_no_credentials_names_everything_tried(tmp_path):
    with pytest.raises(KubeCredentialsError) as caught:
        find_credentials(
            "",
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1"},
            home=str(tmp_path),
            service_account_dir=str(tmp_path / "sa"),
        )
    text = str(caught.value)
    for part in (
        "kubernetes.kubeconfig: not set",
        "$KUBECONFIG: not set",
        f"{tmp_path}/sa/token: no such file",
        f"{tmp_path}/.kube/config: no such file",
        "set kubernetes.kubeconfig",
        "kubernetes.enabled: false",
    ):
        assert part in text


def test_api_client_is_private(kubeconfig, tmp_path):
    before = Configuration.get_default_copy().host
    creds = find_credentials(kubeconfig, environ={}, home=str(tmp_path))
    client = new_api_client(creds)
    assert client.configuration.host == "http://127.0.0.1:1"
    assert client.configuration.api_key["BearerToken"].endswith("secret-token")
    assert client.configuration.retries is False
    assert Configuration.get_default_copy().host == before  # the global default untouched
    client.close()


def test_in_cluster_api_client(tmp_path):
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    creds = find_credentials("", environ, home=str(tmp_path), service_account_dir=str(sa))
    client = new_api_client(creds, environ)
    assert client.configuration.host == "https://10.96.0.1:443"
    assert client.configuration.api_key["BearerToken"] == "bearer sa-token"
    assert client.configuration.ssl_ca_cert == str(sa / "ca.crt")
    client.close()


def test_unusable_kubeconfig(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    creds = find_credentials(str(path), environ={}, home=str(tmp_path))
    with pytest.raises(KubeCredentialsError) as caught:
        new_api_client(creds)
    assert str(path) in str(caught.value)
    assert caught.value.__cause__ is not None


# --- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (401, KubeForbidden),
        (403, KubeForbidden),
        (404, KubeNotFound),
        (409, KubeConflict),
        (410, KubeExpired),
        (429, KubeUnavailable),
        (500, KubeUnavailable),
        (503, KubeUnavailable),
        (0, KubeUnavailable),
        (422, KubeApiError),
    ],
)
def test_map_api_exception(status, cls):
    error = map_error(ApiException(status=status, reason="R"), "patch", "pods/ml/train-0")
    assert type(error) is cls
    assert "patch pods/ml/train-0" in str(error)


def test_forbidden_names_verb_resource_and_deploy():
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = '{"kind":"Status","message":"nodes \\"n\\" is forbidden: cannot patch"}'
    error = map_error(exc, "patch", "nodes/status/node-a")
    assert "may not patch nodes/status" in str(error)
    assert "deploy/" in str(error)
    assert 'nodes "n" is forbidden' in str(error)  # the server's own message


@pytest.mark.parametrize(
    "exc",
    [
        urllib3.exceptions.NewConnectionError(None, "Connection refused"),
        urllib3.exceptions.ReadTimeoutError(None, "/api", "read timed out"),
        urllib3.exceptions.ProtocolError("connection broken"),
        ConnectionResetError(104, "reset"),
    ],
)
def test_transport_errors_are_unavailable(exc):
    assert type(map_error(exc, "list", "pods")) is KubeUnavailable


def test_permissions_contract():
    assert API_PERMISSIONS == (
        ("", "pods", ("get", "list", "watch", "patch")),
        ("", "nodes", ("get", "patch")),
        ("", "nodes/status", ("patch",)),
        ("", "events", ("create", "patch")),
    )


# --- write queue ---------------------------------------------------------------


def test_queue_coalesces_per_key():
    clock = FakeClock()
    queue = WriteQueue(clock)
    queue.put(("pod", "a"), {"x": "1", "y": "1"}, merge_keys)
    queue.put(("pod", "a"), {"y": "2", "z": None}, merge_keys)
    queue.put(("labels",), {"old": "1"}, replace)
    queue.put(("labels",), {"new": "1"}, replace)
    assert len(queue) == 2
    taken = dict([queue.take(), queue.take()])
    assert taken == {("pod", "a"): {"x": "1", "y": "2", "z": None}, ("labels",): {"new": "1"}}
    assert queue.take() is None


def test_queue_backoff_doubles_to_cap_and_resets():
    clock = FakeClock()
    queue = WriteQueue(clock, initial_backoff_seconds=0.5, max_backoff_seconds=4.0)
    queue.put("k", 1)
    delays = []
    for _ in range(6):
        key, value = queue.take()
        delays.append(queue.retry(key, value, replace, "down"))
        assert queue.take() is None  # not due yet
        assert queue.seconds_until_due() == pytest.approx(delays[-1])
        clock.now += delays[-1]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    key, value = queue.take()
    queue.retry(key, value, replace, "down")
    queue.reset_backoff()  # the server is back
    assert queue.take() == ("k", 1)
    assert queue.retry("k", 1, replace, "down") == 0.5


def test_queue_value_queued_while_in_flight():
    clock = FakeClock()
    queue = WriteQueue(clock)
    queue.put("pod", {"a": "1"}, merge_keys)
    key, value = queue.take()
    queue.put("pod", {"b": "2"}, merge_keys)
    assert queue.take() is None  # one write per key at a time
    assert len(queue) == 1
    # The write fails: the newer value is merged over the failed one and waits out the backoff.
    queue.retry(key, value, merge_keys, "down")
    assert queue.pending_value("pod") == {"a": "1", "b": "2"}
    assert queue.take() is None
    clock.now += 0.5
    key, value = queue.take()
    queue.put("pod", {"a": "3"}, merge_keys)
    queue.done(key)  # success: the newer value goes next, at once
    assert queue.take() == ("pod", {"a": "3"})
    queue.done("pod")
    assert len(queue) == 0


# --- event rate limit ------------------------------------------------------------


def test_event_limiter_folds_suppressed_into_next():
    clock = FakeClock()
    limiter = EventLimiter(clock, per_key_interval_seconds=60.0)
    key = ("ml", "train-0", "GPUShareRefused")
    assert limiter.admit(key) == 1
    for _ in range(4):
        clock.now += 10
        assert limiter.admit(key) is None
    assert limiter.suppressed(key) == 4
    assert limiter.admit(("ml", "other", "GPUShareRefused")) == 1  # another pod: its own window
    clock.now += 21  # 61 s after the first
    assert limiter.admit(key) == 5  # this one and the 4 suppressed
    assert limiter.suppressed(key) == 0


def test_event_limiter_overall_rate():
    clock = FakeClock()
    limiter = EventLimiter(clock, rate_per_second=5.0, burst=5.0)
    admitted = [limiter.admit(("ns", f"pod-{i}", "R")) for i in range(8)]
    assert admitted == [1] * 5 + [None] * 3
    clock.now += 0.2  # one token back
    assert limiter.admit(("ns", "pod-5", "R")) == 2  # its suppressed occurrence folded in
    assert limiter.admit(("ns", "pod-6", "R")) is None


def test_event_limiter_forgets_old_keys():
    clock = FakeClock()
    limiter = EventLimiter(clock, per_key_interval_seconds=60.0, rate_per_second=5.0, burst=5.0)
    for i in range(10):
        limiter.admit(("ns", f"pod-{i}", "R"))  # 5 sent, 5 suppressed by the overall rate
    clock.now += 61
    limiter.admit(("ns", "new", "R"))
    # Sent keys are forgotten after their interval; suppressed counts wait for a next event...
    assert limiter.suppressed(("ns", "pod-9", "R")) == 1
    assert len(limiter._keys) == 6
    clock.now += 600
    limiter.admit(("ns", "new", "R"))
    assert len(limiter._keys) == 1  # ...but not for ever (pods come and go)


# --- against the test API server -------------------------------------------------
#
# TestApiServer speaks the real REST and watch protocol, so the kubernetes
# client runs end to end: what these pin is what a real API server would see.

NODE = "node-a"
PREFIX = "gpushare.aliyun.com/"
TIMEOUT_SECONDS = 1.0  # kubernetes.request_timeout_seconds in these tests


def wait_until(predicate, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def requests_of(api, method, path_regex, watch=None):
    rx = re.compile(path_regex)
    return [
        (m, p, q)
        for m, p, q in list(api.requests)
        if m == method
        and rx.search(p)
        and (watch is None or (q.get("watch") in ("true", "1")) == watch)
    ]


@pytest.fixture
def api(tmp_path):
    server = TestApiServer()
    server.start()
    server.add_node(NODE, labels={"team": "vision", PREFIX + "stale": "1"})
    yield server
    server.stop()


@pytest.fixture
def make_adapter(api, tmp_path):
    made = []
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")

    def make(start=True, clock=time.time, **kwargs):
        settings = KubernetesSettings(
            kubeconfig=kubeconfig, request_timeout_seconds=TIMEOUT_SECONDS
        )
        kwargs.setdefault("max_backoff_seconds", 0.4)  # 30 s in production
        kwargs.setdefault("initial_backoff_seconds", 0.05)
        adapter = KubeAdapter(settings, NODE, clock, **kwargs)
        made.append(adapter)
        if start:
            adapter.start()
            wait_until(lambda: adapter.synced, what="initial LIST")
            wait_until(lambda: adapter.state()["watching"], what="WATCH")
        return adapter

    yield make
    for adapter in made:
        adapter.stop()
        adapter.join(2.0)


def names(adapter):
    return sorted(f"{p.namespace}/{p.name}" for p in adapter.pods())


def test_cache_lists_then_follows_this_nodes_pods(api, make_adapter):
    api.add_pod(
        "ml",
        "train-0",
        NODE,
        containers=[{"name": "main", "requests": {MEM: "4", CORE: "30"}}],
        init_containers=[{"name": "init", "requests": {MEM: "1"}}],
    )
    api.add_pod("ml", "elsewhere", "node-b")
    adapter = make_adapter()
    assert names(adapter) == ["ml/train-0"]
    info = adapter.pod("ml", "train-0")
    stored = api.pod("ml", "train-0")
    assert info.uid == stored["metadata"]["uid"]
    assert info.containers == (ContainerRequest("main", {MEM: 4, CORE: 30}),)
    assert info.init_containers == (ContainerRequest("init", {MEM: 1}),)
    assert info.created_at == pytest.approx(time.time(), abs=60)

    # One LIST and one WATCH, both with the field selector of this node.
    lists = requests_of(api, "GET", r"^/api/v1/pods$", watch=False)
    watches = requests_of(api, "GET", r"^/api/v1/pods$", watch=True)
    assert len(lists) == 1 and len(watches) == 1
    for _, _, query in lists + watches:
        assert query["fieldSelector"] == f"spec.nodeName={NODE}"
    assert watches[0][2]["resourceVersion"]  # from the LIST's version, not a fresh state

    generation = adapter.generation
    api.add_pod("ml", "train-1", NODE)
    assert adapter.wait_for_change(generation, 5.0) > generation
    wait_until(lambda: names(adapter) == ["ml/train-0", "ml/train-1"], what="ADDED")
    api.update_pod(
        "ml", "train-0", lambda p: p["metadata"].setdefault("annotations", {}).update(x="1") or p
    )
    wait_until(lambda: adapter.pod("ml", "train-0").annotations.get("x") == "1", what="MODIFIED")
    api.delete_pod("ml", "train-1", graceful=True)
    wait_until(lambda: adapter.pod("ml", "train-1").deleting, what="terminating")
    api.delete_pod("ml", "train-1")
    wait_until(lambda: names(adapter) == ["ml/train-0"], what="DELETED")
    api.add_pod("ml", "elsewhere-2", "node-b")
    api.set_pod_phase("ml", "train-0", "Running")
    wait_until(lambda: adapter.pod("ml", "train-0").phase == "Running", what="phase")
    assert names(adapter) == ["ml/train-0"]  # node-b's pods never arrive
    assert len(requests_of(api, "GET", r"^/api/v1/pods$", watch=False)) == 1  # no relist


def test_candidate_index_follows_events_without_walking_the_cache(api, make_adapter):
    from nodemgr.domain.podmatch import is_candidate_pod

    api.add_pod("ml", "pending-gpu", NODE, containers=[{"name": "m", "requests": {MEM: "2"}}])
    api.add_pod("ml", "running-gpu", NODE, phase="Running")
    api.add_pod("ml", "pending-cpu", NODE, containers=[{"name": "m", "requests": {"cpu": "1"}}])
    adapter = make_adapter(candidate_filter=lambda pod: is_candidate_pod(pod, (MEM, CORE)))

    def candidates():
        return sorted(p.name for p in adapter.candidates())

    assert candidates() == ["pending-gpu"]  # from the LIST
    api.add_pod("ml", "new-gpu", NODE, containers=[{"name": "m", "requests": {CORE: "20"}}])
    wait_until(lambda: candidates() == ["new-gpu", "pending-gpu"], what="ADDED candidate")
    api.set_pod_phase("ml", "pending-gpu", "Running")
    wait_until(lambda: candidates() == ["new-gpu"], what="admitted pod leaves the index")
    api.delete_pod("ml", "new-gpu")
    wait_until(lambda: candidates() == [], what="DELETED candidate")
    assert len(adapter.pods()) == 3  # the cache itself still holds the other pods


def test_relist_after_expired_watch(api, make_adapter):
    api.add_pod("ml", "old", NODE)
    adapter = make_adapter()
    assert names(adapter) == ["ml/old"]
    # The watch ends; its resumption waits while the history is compacted
    # past the version the adapter knows: the server answers 410 and the
    # adapter must list again to see what happened meanwhile.
    api.delay_next("GET", r"^/api/v1/pods$", 0.5, watch=True)
    api.drop_watches()
    api.delete_pod("ml", "old")
    api.add_pod("ml", "new", NODE)
    api.compact()
    wait_until(lambda: names(adapter) == ["ml/new"], what="relist")
    assert len(requests_of(api, "GET", r"^/api/v1/pods$", watch=False)) == 2
    assert adapter.synced
    api.add_pod("ml", "newer", NODE)  # and it watches again
    wait_until(lambda: names(adapter) == ["ml/new", "ml/newer"], what="watch after relist")


def test_relist_when_the_servers_versions_went_back(api, make_adapter):
    api.add_pod("ml", "old", NODE)
    adapter = make_adapter()
    # An API server restored from an older etcd at the same address: the
    # adapter's resourceVersion is ahead of it ("Too large resource version").
    api.stop()
    restored = TestApiServer(token=api.token)
    restored._port = api._port  # the same address (the simulator has no public knob for it)
    restored.start()
    try:
        restored.add_pod("ml", "restored", NODE)
        assert restored.resource_version < int(adapter.pod("ml", "old").resource_version)
        wait_until(lambda: names(adapter) == ["ml/restored"], what="relist")
        assert adapter.synced
    finally:
        restored.stop()


def test_clean_watch_end_resumes_without_relist(api, make_adapter):
    adapter = make_adapter()
    api.drop_watches()
    api.add_pod("ml", "p", NODE)
    wait_until(lambda: names(adapter) == ["ml/p"], what="resumed watch")
    assert len(requests_of(api, "GET", r"^/api/v1/pods$", watch=False)) == 1
    assert len(requests_of(api, "GET", r"^/api/v1/pods$", watch=True)) >= 2


def test_reconnect_after_restart_delivers_latest_coalesced_writes(api, make_adapter):
    api.add_pod("ml", "p", NODE)
    adapter = make_adapter()
    api.stop()
    wait_until(lambda: not adapter.state()["connected"], what="disconnected")
    adapter.patch_pod_annotations("ml", "p", {"a": "1", "b": "1"})
    adapter.set_node_labels({"gpu-model": "T4"})
    time.sleep(0.5)  # a few failed attempts while it is down
    adapter.patch_pod_annotations("ml", "p", {"a": "2", "c": None})
    adapter.set_node_labels({"gpu-count": "2"})
    state = adapter.state()
    assert state["pending_writes"] == 2 and state["connected"] is False
    assert "no answer from the API server" in state["last_error"]
    api.add_pod("ml", "while-down", NODE)  # the watch has to catch up on it

    api.start()
    wait_until(lambda: api.pod("ml", "p")["metadata"].get("annotations") == {"a": "2", "b": "1"})
    wait_until(lambda: PREFIX + "gpu-count" in api.node(NODE)["metadata"]["labels"])
    labels = api.node(NODE)["metadata"]["labels"]
    assert PREFIX + "gpu-model" not in labels  # the newer desired set replaced it
    assert len(requests_of(api, "PATCH", r"/pods/p$")) == 1  # coalesced into one request
    wait_until(lambda: "ml/while-down" in names(adapter), what="watch reconnected")
    wait_until(lambda: adapter.state()["pending_writes"] == 0)
    assert adapter.state()["connected"] is True


def test_server_errors_are_retried(api, make_adapter):
    api.add_pod("ml", "p", NODE)
    adapter = make_adapter()
    api.fail_next("PATCH", r"/pods/p$", 500, count=2)
    api.fail_next("PATCH", r"/nodes/node-a$", 429, count=1)
    adapter.patch_pod_annotations("ml", "p", {"a": "1"})
    adapter.set_node_annotations({PREFIX + "cards": "{}"})
    wait_until(lambda: api.pod("ml", "p")["metadata"].get("annotations") == {"a": "1"})
    wait_until(lambda: api.node(NODE)["metadata"]["annotations"].get(PREFIX + "cards") == "{}")
    assert len(requests_of(api, "PATCH", r"/pods/p$")) == 3
    assert len(requests_of(api, "PATCH", r"/nodes/node-a$")) == 2


def test_timed_out_request_is_retried(api, make_adapter):
    api.add_pod("ml", "p", NODE)
    adapter = make_adapter()
    api.delay_next("PATCH", r"/pods/p$", TIMEOUT_SECONDS + 1.0)
    began = time.monotonic()
    adapter.patch_pod_annotations("ml", "p", {"a": "1"})
    # The first attempt times out after request_timeout_seconds; the retry
    # lands before the delayed first one is carried out.
    wait_until(lambda: len(requests_of(api, "PATCH", r"/pods/p$")) == 2, what="retry")
    wait_until(lambda: api.pod("ml", "p")["metadata"].get("annotations") == {"a": "1"})
    assert time.monotonic() - began < TIMEOUT_SECONDS + 1.0
    assert "timed out" in adapter.state()["last_error"].lower()


def test_write_for_a_gone_pod_is_dropped(api, make_adapter, caplog):
    adapter = make_adapter()
    with caplog.at_level(logging.INFO, logger="nodemgr.kubernetes.adapter"):
        adapter.patch_pod_annotations("ml", "gone", {"a": "1"})
        wait_until(lambda: adapter.state()["pending_writes"] == 0, what="dropped")
        time.sleep(0.3)
    assert len(requests_of(api, "PATCH", r"/pods/gone$")) == 1  # never retried
    assert any("ml/gone" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)


def test_forbidden_write_is_dropped_and_names_the_rbac(api, make_adapter, caplog):
    adapter = make_adapter()
    api.fail_next("PATCH", r"/nodes/node-a/status$", 403, count=2)
    with caplog.at_level(logging.ERROR, logger="nodemgr.kubernetes.adapter"):
        adapter.set_node_extended_resources({"aliyun.com/gpu-count": 2})
        wait_until(lambda: adapter.state()["pending_writes"] == 0, what="dropped")
    assert len(requests_of(api, "PATCH", r"/nodes/node-a/status$")) == 1
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "may not patch nodes/status" in record.getMessage()
    assert "deploy/" in record.getMessage()
    assert "may not patch nodes/status" in adapter.state()["last_error"]


def test_node_labels_only_under_the_prefix(api, make_adapter):
    adapter = make_adapter()
    adapter.set_node_labels({"gpu-model": "Tesla-T4", "gpu-count": "2", "bad": "Tesla T4"})
    wait_until(lambda: PREFIX + "gpu-model" in api.node(NODE)["metadata"]["labels"])
    labels = api.node(NODE)["metadata"]["labels"]
    assert labels["team"] == "vision"  # foreign: untouched
    assert labels["kubernetes.io/hostname"] == NODE
    assert PREFIX + "stale" not in labels  # ours, no longer desired: removed
    assert PREFIX + "bad" not in labels  # not a valid label value: never sent
    assert labels[PREFIX + "gpu-count"] == "2"

    patches = len(requests_of(api, "PATCH", r"/nodes/node-a$"))
    adapter.set_node_labels({"gpu-model": "Tesla-T4", "gpu-count": "2"})
    wait_until(lambda: len(requests_of(api, "GET", r"/nodes/node-a$")) == 2, what="re-read")
    wait_until(lambda: adapter.state()["pending_writes"] == 0)
    assert len(requests_of(api, "PATCH", r"/nodes/node-a$")) == patches  # nothing to change

    adapter.set_node_labels({})
    wait_until(lambda: PREFIX + "gpu-model" not in api.node(NODE)["metadata"]["labels"])
    labels = api.node(NODE)["metadata"]["labels"]
    assert not [k for k in labels if k.startswith(PREFIX)]
    assert labels["team"] == "vision"


def test_extended_resources_in_capacity_and_allocatable(api, make_adapter):
    adapter = make_adapter()
    adapter.set_node_extended_resources({"aliyun.com/gpu-count": 2})
    wait_until(lambda: "aliyun.com/gpu-count" in api.node(NODE)["status"]["allocatable"])
    status = api.node(NODE)["status"]
    assert status["capacity"]["aliyun.com/gpu-count"] == "2"
    assert status["allocatable"]["aliyun.com/gpu-count"] == "2"
    assert status["capacity"]["cpu"] == "16"  # the rest of the status untouched
    assert status["conditions"][0]["type"] == "Ready"
    adapter.set_node_extended_resources({"aliyun.com/gpu-count": None})
    wait_until(lambda: "aliyun.com/gpu-count" not in api.node(NODE)["status"]["capacity"])
    assert "aliyun.com/gpu-count" not in api.node(NODE)["status"]["allocatable"]


def test_events_are_rate_limited_and_folded(api, make_adapter):
    pod = api.add_pod("ml", "p", NODE)
    clock = FakeClock(time.time())
    adapter = make_adapter(clock=clock)
    for i in range(10):
        adapter.record_event("ml", "p", "GPUShareRefused", f"no card fits 4 GiB (try {i})")
    wait_until(lambda: len(api.events()) == 1, what="first event")
    time.sleep(0.3)
    [event] = api.events()
    assert (event["reason"], event["count"], event["type"]) == ("GPUShareRefused", 1, "Warning")
    assert event["message"] == "no card fits 4 GiB (try 0)"
    assert event["involvedObject"]["kind"] == "Pod"
    assert event["involvedObject"]["uid"] == pod["metadata"]["uid"]
    assert event["source"] == {"component": "gpushare-node", "host": NODE}

    clock.now += 61  # past the per-pod interval: the next one carries the 9 suppressed
    adapter.record_event("ml", "p", "GPUShareRefused", "no card fits 4 GiB (try 10)")
    wait_until(lambda: api.events()[0]["count"] == 11, what="folded count")
    [event] = api.events()  # the same Event, patched (as kubelet's recorder does)
    assert event["message"] == "no card fits 4 GiB (try 10)"
    adapter.record_event("ml", "p", "GPUQuotaViolation", "over quota on card 0", "Warning")
    wait_until(lambda: len(api.events()) == 2, what="another reason: its own event")


def test_allocate_path_calls_never_wait_on_the_api_server(api, make_adapter):
    api.add_pod("ml", "p", NODE)
    adapter = make_adapter()

    def slowest_call_seconds():
        slowest = 0.0
        for i in range(50):
            began = time.perf_counter()
            adapter.pods()
            adapter.generation  # noqa: B018
            adapter.wait_for_change(adapter.generation - 1, 1.0)
            adapter.patch_pod_annotations("ml", "p", {"n": str(i)})
            adapter.record_event("ml", "p", "R", "m")
            slowest = max(slowest, time.perf_counter() - began)
        return slowest

    # Hung: every new request sleeps; the writer thread is stuck in one.
    api.delay_next("*", r".", 3.0, count=100)
    adapter.patch_pod_annotations("ml", "p", {"first": "1"})
    wait_until(lambda: len(requests_of(api, "PATCH", r"/pods/p$")) >= 1, what="writer busy")
    assert slowest_call_seconds() < 0.05
    # Down: connections refused.
    api.stop()
    assert slowest_call_seconds() < 0.05
    assert names(adapter) == ["ml/p"]  # the cache stays readable


def test_stop_is_prompt(api, make_adapter):
    adapter = make_adapter()
    # A quiet watch stream: stop() must wake the blocked read, not wait it out.
    began = time.monotonic()
    adapter.stop()
    assert adapter.join(1.0)
    assert time.monotonic() - began < 1.0
    assert not any(t.name in ("kube-watch", "kube-writer") for t in adapter_threads(adapter))

    hung = make_adapter()
    api.delay_next("*", r".", 5.0, count=100)
    api.drop_watches()  # the watch's next request hangs...
    hung.patch_pod_annotations("ml", "none", {"a": "1"})  # ...and so does the writer's
    wait_until(lambda: len(requests_of(api, "PATCH", r"/pods/none$")) >= 1, what="writer busy")
    generation = hung.generation
    began = time.monotonic()
    hung.stop()
    hung.join(1.0)  # gives up on the hung requests: their threads are abandoned
    assert time.monotonic() - began < 1.5
    hung.patch_pod_annotations("ml", "none", {"a": "2"})  # after stop: dropped, no error
    assert hung.generation == generation


def adapter_threads(adapter):
    return [t for t in (adapter._watch.thread, adapter._writer) if t.is_alive()]


def test_without_credentials_logs_one_line_and_does_nothing(tmp_path, caplog):
    before = set(threading.enumerate())
    settings = KubernetesSettings()  # kubeconfig "" : look everywhere
    adapter = KubeAdapter(
        settings, NODE, environ={}, home=str(tmp_path), service_account_dir=str(tmp_path / "sa")
    )
    with caplog.at_level(logging.DEBUG, logger="nodemgr.kubernetes.adapter"):
        adapter.start()
        adapter.patch_pod_annotations("ml", "p", {"a": "1"})
        adapter.set_node_labels({"gpu-model": "T4"})
        adapter.record_event("ml", "p", "R", "m")
        assert adapter.pods() == [] and adapter.generation == 0 and not adapter.synced
        adapter.stop()
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    assert "plain device plugin" in text and "$KUBECONFIG: not set" in text
    assert f"{tmp_path}/.kube/config: no such file" in text
    assert "kubernetes.enabled: false" in text
    new_threads = set(threading.enumerate()) - before
    assert not [t for t in new_threads if t.name.startswith("kube")]
    state = adapter.state()
    assert state["active"] is False and state["credentials"] is None
    assert state["pending_writes"] == 0 and "no Kubernetes credentials" in state["last_error"]


def test_disabled_does_nothing(tmp_path, caplog):
    adapter = KubeAdapter(KubernetesSettings(enabled=False), NODE, home=str(tmp_path))
    before = set(threading.enumerate())
    with caplog.at_level(logging.DEBUG, logger="nodemgr.kubernetes.adapter"):
        adapter.start()
        adapter.set_node_annotations({"a": "1"})
        adapter.record_event("ml", "p", "R", "m")
    [record] = caplog.records
    assert "kubernetes.enabled is false" in record.getMessage()
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("kube")]
    state = adapter.state()
    assert (state["enabled"], state["active"], state["pending_writes"]) == (False, False, 0)
