"""The Kubernetes adapter (nodemgr.kube, kube_client, kube_writes).

Pins, without an API server: a pod from the API as PodInfo (raw JSON and
V1Pod; extended resources only, limits standing in for missing requests,
integer quantities), where credentials come from and the one error naming
what was tried, an ApiClient that leaves the client's global configuration
alone, the mapping of client errors to the KubeApiError classes, the
coalescing write queue and its backoff, and the event rate limit.

Against the test API server (tests/kube_apiserver_sim.py, real REST and
watch protocol, the real client end to end): see the second half.
"""

from __future__ import annotations

import pytest
import urllib3
from kubernetes.client import Configuration, V1Pod
from kubernetes.client.exceptions import ApiException

from nodemgr.errors import (
    KubeApiError,
    KubeConflict,
    KubeCredentialsError,
    KubeExpired,
    KubeForbidden,
    KubeNotFound,
    KubeUnavailable,
)
from nodemgr.kube import API_PERMISSIONS
from nodemgr.kube_client import find_credentials, map_error, new_api_client, rfc3339
from nodemgr.kube_watch import extended_requests, is_extended_resource, pod_info
from nodemgr.kube_writes import EventLimiter, WriteQueue, merge_keys, replace
from nodemgr.podmatch import ContainerRequest

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
