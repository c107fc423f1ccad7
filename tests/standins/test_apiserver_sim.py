"""Tests of the test API server (standins/apiserver_sim.py) through the real client.

Every test drives the official ``kubernetes`` client, configured from the kubeconfig the
server writes (never the client's global default configuration), so they pin both the
server's wire behaviour and what the client makes of it, which the daemon's adapter
relies on:

* list with field/label selectors; the list's resourceVersion;
* watch from a resourceVersion: ADDED/MODIFIED/DELETED in order, replayed then live, and
  a pod bound to the node later arriving as ADDED on a node-filtered watch;
* a watch from a compacted RV: ``Watch().stream`` raises ``ApiException`` 410 (at once
  with ``timeout_seconds``; after one retry without it); an Exact list gives HTTP 410;
* strategic merge, merge and JSON patch (the client picks JSON patch for a list body),
  409 on a stale resourceVersion, no-op patches, node labels and status;
* events (201; naive times and wrong namespaces refused as by a real server);
* SelfSubjectAccessReviews (what ``kubectl auth can-i`` asks): all allowed by default,
  else only the (resource[/subresource], verb) pairs in ``rbac_allowed``; 422 for a review
  without attributes; a node added with an address and annotations;
* failure injection (5xx, delays: a PATCH times out but is applied anyway, a GET is
  retried by urllib3), 401 without the token, 404/405/415;
* resource.k8s.io/v1 through ResourceV1Api: discovery, slices stored with canonical
  quantities, listed and watched by node, wiped by node with deletecollection; an
  invalid slice answered 422 with field causes, a bad quantity 400; claims created
  without status, allocated through the status subresource (the main resource keeps
  it), their spec immutable; classes and templates;
* stop() breaks an open watch (urllib3 ProtocolError) and refuses connections,
  restart() serves the same data on the same port, drop_watches() ends watches cleanly
  (the client resumes from its last RV), bookmarks.

Why this module is longer than 400 lines: it holds the API server stand-in to the real
server's behaviour, request by request, as the stand-in itself is large.
"""

import datetime
import json
import threading
import time

import kubernetes
import pytest
import urllib3
from kubernetes import client, watch

from standins.apiserver_sim import TestApiServer, json_patch

GPU = "aliyun.com/gpu-mem"


@pytest.fixture
def server():
    s = TestApiServer()
    s.start()
    yield s
    s.stop()


def make_api(server, tmp_path, token=True):
    cfg = client.Configuration()
    path = server.write_kubeconfig(tmp_path / "kubeconfig")
    kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)
    if not token:
        cfg.api_key = {}
    return client.ApiClient(cfg)


@pytest.fixture
def v1(server, tmp_path):
    api = make_api(server, tmp_path)
    yield client.CoreV1Api(api)
    api.close()


def watch_requests(server):
    return [q for m, _, q in server.requests if m == "GET" and q.get("watch") == "true"]


def test_list_pods_with_selectors(server, v1):
    server.add_pod("default", "a", "node-a", labels={"app": "x"})
    server.add_pod("kube-system", "b", "node-a")
    server.add_pod("default", "c", "node-b")
    server.add_pod("default", "pending", None)

    pods = v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-a")
    assert [(p.metadata.namespace, p.metadata.name) for p in pods.items] == [
        ("default", "a"),
        ("kube-system", "b"),
    ]
    assert pods.metadata.resource_version == str(server.resource_version)
    # What the daemon reads from a pod: requests and limits, both set for extended resources.
    res = pods.items[0].spec.containers[0].resources
    assert res.requests == {GPU: "4"} and res.limits == {GPU: "4"}

    names = v1.list_namespaced_pod("default", field_selector="spec.nodeName!=node-a")
    assert [p.metadata.name for p in names.items] == ["c", "pending"]
    labelled = v1.list_namespaced_pod("default", label_selector="app in (x,y)")
    assert [p.metadata.name for p in labelled.items] == ["a"]
    assert v1.read_namespaced_pod("a", "default").spec.node_name == "node-a"
    with pytest.raises(client.ApiException) as e:
        v1.list_pod_for_all_namespaces(field_selector="spec.foo=bar")
    assert e.value.status == 400
    with pytest.raises(client.ApiException) as e:
        v1.read_namespaced_pod("nope", "default")
    assert e.value.status == 404


def test_watch_from_resource_version_replays_then_streams_live(server, v1):
    server.add_pod("default", "old", "node-a")
    rv = v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-a").metadata
    rv = rv.resource_version
    # Changes after the list: replayed from history.
    server.add_pod("default", "p1", "node-a")
    server.update_pod("default", "p1", lambda p: p["metadata"].update(annotations={"k": "v"}))
    server.add_pod("default", "elsewhere", "node-b")

    replayed = threading.Event()  # the client got the history: what follows is live

    def live_changes():
        assert replayed.wait(10)
        server.set_pod_phase("default", "p1", "Running")
        server.delete_pod("default", "p1")
        server.add_pod("default", "late", None)  # scheduled later: not on node-a yet
        server.update_pod("default", "late", lambda p: p["spec"].update(nodeName="node-a"))

    threading.Thread(target=live_changes).start()
    seen = []
    w = watch.Watch()
    for ev in w.stream(
        v1.list_pod_for_all_namespaces,
        field_selector="spec.nodeName=node-a",
        resource_version=rv,
        timeout_seconds=10,
    ):
        pod = ev["object"]
        seen.append((ev["type"], pod.metadata.name, pod.status.phase))
        if len(seen) == 2:
            replayed.set()
        assert int(pod.metadata.resource_version) > int(rv)  # strictly increasing
        rv = pod.metadata.resource_version
        if pod.metadata.name == "late":
            w.stop()
    assert seen == [
        ("ADDED", "p1", "Pending"),
        ("MODIFIED", "p1", "Pending"),
        ("MODIFIED", "p1", "Running"),
        ("DELETED", "p1", "Running"),
        ("ADDED", "late", "Pending"),  # entering the selection is an ADDED
    ]
    assert w.resource_version == rv


def test_watch_from_compacted_resource_version_raises_410(server, v1):
    server.add_pod("default", "p1", "node-a")
    rv = v1.list_pod_for_all_namespaces().metadata.resource_version
    server.set_pod_phase("default", "p1", "Running")
    server.compact()

    with pytest.raises(client.ApiException) as e:
        for _ in watch.Watch().stream(
            v1.list_pod_for_all_namespaces, resource_version=rv, timeout_seconds=5
        ):
            pass
    assert e.value.status == 410
    assert f"too old resource version: {rv}" in e.value.reason
    assert len(watch_requests(server)) == 1  # with timeout_seconds: no retry

    server.requests.clear()
    with pytest.raises(client.ApiException) as e:
        for _ in watch.Watch().stream(v1.list_pod_for_all_namespaces, resource_version=rv):
            pass
    assert e.value.status == 410
    assert len(watch_requests(server)) == 2  # without: one retry from the same RV, then 410

    # The current RV still works, and a list with an Exact expired RV is an HTTP 410.
    current = v1.list_pod_for_all_namespaces().metadata.resource_version
    events = list(
        watch.Watch().stream(
            v1.list_pod_for_all_namespaces, resource_version=current, timeout_seconds=1
        )
    )
    assert events == []
    with pytest.raises(client.ApiException) as e:
        v1.list_pod_for_all_namespaces(resource_version=rv, resource_version_match="Exact")
    assert e.value.status == 410
    future = str(int(current) + 5)  # an RV this server never gave out
    with pytest.raises(client.ApiException) as e:
        list(watch.Watch().stream(v1.list_pod_for_all_namespaces, resource_version=future))
    assert e.value.status == 504


def test_list_at_exact_resource_version(server, v1):
    server.add_pod("default", "p1", "node-a", annotations={"a": "1"})
    rv = v1.list_pod_for_all_namespaces().metadata.resource_version
    server.update_pod("default", "p1", lambda p: p["metadata"].update(annotations={"a": "2"}))
    server.add_pod("default", "p2", "node-a")
    then = v1.list_pod_for_all_namespaces(resource_version=rv, resource_version_match="Exact")
    assert then.metadata.resource_version == rv
    assert [(p.metadata.name, p.metadata.annotations) for p in then.items] == [("p1", {"a": "1"})]


def test_strategic_merge_patch_of_annotations(server, v1):
    server.add_pod("default", "p1", "node-a", annotations={"keep": "1", "drop": "2"})
    before = server.resource_version
    body = {"metadata": {"annotations": {"ALIYUN_COM_GPU_MEM_ASSIGNED": "true", "drop": None}}}
    pod = v1.patch_namespaced_pod("p1", "default", body)
    assert pod.metadata.annotations == {"keep": "1", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}
    assert int(pod.metadata.resource_version) == before + 1
    assert server.pod("default", "p1")["metadata"]["annotations"] == pod.metadata.annotations
    method, path, _ = server.requests[-1]
    assert (method, path) == ("PATCH", "/api/v1/namespaces/default/pods/p1")

    # The same patch again changes nothing: no new resourceVersion, no watch event.
    again = v1.patch_namespaced_pod("p1", "default", body)
    assert again.metadata.resource_version == pod.metadata.resource_version
    # Status goes through the status subresource only.
    v1.patch_namespaced_pod("p1", "default", {"status": {"phase": "Failed"}})
    assert server.pod("default", "p1")["status"]["phase"] == "Pending"
    v1.patch_namespaced_pod_status("p1", "default", {"status": {"phase": "Failed"}})
    assert server.pod("default", "p1")["status"]["phase"] == "Failed"


def test_merge_patch_and_json_patch(server, v1):
    server.add_pod("default", "p1", "node-a")  # no annotations: the field is absent
    assert "annotations" not in server.pod("default", "p1")["metadata"]

    # A list body makes the client send application/json-patch+json.
    add = [{"op": "add", "path": "/metadata/annotations/a~1b", "value": "x"}]
    with pytest.raises(client.ApiException) as e:
        v1.patch_namespaced_pod("p1", "default", add)
    assert e.value.status == 422  # the parent path does not exist, as on a real server
    ops = [{"op": "add", "path": "/metadata/annotations", "value": {}}, *add]
    pod = v1.patch_namespaced_pod("p1", "default", ops)
    assert pod.metadata.annotations == {"a/b": "x"}
    rv = pod.metadata.resource_version
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "replace", "path": "/metadata/annotations/a~1b", "value": "y"},
        {"op": "add", "path": "/metadata/labels", "value": {"t": "1"}},
    ]
    assert v1.patch_namespaced_pod("p1", "default", ops).metadata.annotations == {"a/b": "y"}
    with pytest.raises(client.ApiException) as e:  # the test op fails now: rv is stale
        v1.patch_namespaced_pod("p1", "default", ops)
    assert e.value.status == 422
    remove = [{"op": "remove", "path": "/metadata/labels/t"}]
    assert v1.patch_namespaced_pod("p1", "default", remove).metadata.labels is None

    # Keys with "~" cannot occur in metadata; the pointer escaping, directly:
    assert json_patch({"a~b": {"c/d": 1}}, [{"op": "remove", "path": "/a~0b/c~1d"}]) == {"a~b": {}}

    merge = {"metadata": {"annotations": {"a/b": None, "c": "d"}}}
    pod = v1.patch_namespaced_pod(
        "p1", "default", merge, _content_type="application/merge-patch+json"
    )
    assert pod.metadata.annotations == {"c": "d"}


def test_conflict_on_stale_resource_version(server, v1):
    server.add_pod("default", "p1", "node-a")
    stale = server.pod("default", "p1")["metadata"]["resourceVersion"]
    server.update_pod("default", "p1", lambda p: p["metadata"].update(labels={"x": "1"}))
    body = {"metadata": {"resourceVersion": stale, "annotations": {"a": "b"}}}
    with pytest.raises(client.ApiException) as e:
        v1.patch_namespaced_pod("p1", "default", body)
    assert e.value.status == 409
    assert '"reason":"Conflict"' in e.value.body.replace(" ", "")
    assert "annotations" not in server.pod("default", "p1")["metadata"]
    body["metadata"]["resourceVersion"] = server.pod("default", "p1")["metadata"]["resourceVersion"]
    assert v1.patch_namespaced_pod("p1", "default", body).metadata.annotations == {"a": "b"}
    opts = client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version=stale))
    with pytest.raises(client.ApiException) as e:
        v1.delete_namespaced_pod("p1", "default", body=opts)
    assert e.value.status == 409
    assert v1.delete_namespaced_pod("p1", "default").metadata.name == "p1"
    assert server.pod("default", "p1") is None


def test_patch_node_labels_and_status(server, v1):
    server.add_node("node-a")
    node = v1.patch_node("node-a", {"metadata": {"labels": {"gpushare/gpu-model": "Tesla-T4"}}})
    assert node.metadata.labels["gpushare/gpu-model"] == "Tesla-T4"
    assert node.metadata.labels["kubernetes.io/hostname"] == "node-a"
    with pytest.raises(client.ApiException) as e:  # spaces are not allowed in label values
        v1.patch_node("node-a", {"metadata": {"labels": {"gpushare/gpu-model": "Tesla T4"}}})
    assert e.value.status == 422

    caps = {"aliyun.com/gpu-count": "2", "aliyun.com/gpu-mem": "30"}
    node = v1.patch_node_status("node-a", {"status": {"capacity": caps, "allocatable": caps}})
    assert node.status.capacity["aliyun.com/gpu-count"] == "2"
    assert node.status.allocatable["aliyun.com/gpu-mem"] == "30"
    assert node.status.capacity["cpu"] == "16"  # merged, not replaced
    gone = {"aliyun.com/gpu-mem": None}
    node = v1.patch_node_status("node-a", {"status": {"capacity": gone, "allocatable": gone}})
    assert "aliyun.com/gpu-mem" not in server.node("node-a")["status"]["capacity"]
    assert "aliyun.com/gpu-mem" not in node.status.allocatable
    # The main resource ignores status, as on a real server.
    v1.patch_node("node-a", {"status": {"capacity": {"x.io/y": "1"}}})
    assert "x.io/y" not in server.node("node-a")["status"]["capacity"]


def test_create_and_patch_event(server, v1):
    now = datetime.datetime.now(datetime.UTC)
    ev = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="p1."),
        involved_object=client.V1ObjectReference(kind="Pod", namespace="default", name="p1"),
        reason="GpuQuotaExceeded",
        message="container used 5 GiB of its 4 GiB",
        type="Warning",
        count=1,
        first_timestamp=now,
        last_timestamp=now,
        source=client.V1EventSource(component="gpushare-node", host="node-a"),
    )
    created = v1.create_namespaced_event("default", ev)
    assert created.metadata.name.startswith("p1.") and created.metadata.uid
    assert server.requests[-1][:2] == ("POST", "/api/v1/namespaces/default/events")
    [stored] = server.events()
    assert stored["reason"] == "GpuQuotaExceeded"
    assert stored["lastTimestamp"] == now.strftime("%Y-%m-%dT%H:%M:%SZ")
    patched = v1.patch_namespaced_event(created.metadata.name, "default", {"count": 2})
    assert patched.count == 2
    assert [e.reason for e in v1.list_namespaced_event("default").items] == ["GpuQuotaExceeded"]

    ev.metadata = client.V1ObjectMeta(name="naive")
    ev.first_timestamp = datetime.datetime.now()  # no zone: a real server refuses it
    with pytest.raises(client.ApiException) as e:
        v1.create_namespaced_event("default", ev)
    assert e.value.status == 400
    ev.first_timestamp = now
    with pytest.raises(client.ApiException) as e:  # not in its pod's namespace
        v1.create_namespaced_event("other", ev)
    assert e.value.status == 422

    events_v1 = client.EventsV1Api(v1.api_client)
    ev2 = client.EventsV1Event(
        metadata=client.V1ObjectMeta(name="n1"),
        event_time=now,
        reason="Started",
        action="Admit",
        reporting_controller="gpushare-node",
        reporting_instance="node-a",
        regarding=client.V1ObjectReference(kind="Node", name="node-a"),
        type="Normal",
    )
    assert events_v1.create_namespaced_event("default", ev2).event_time == now
    assert len(server.events()) == 2


def test_fail_next_and_delay_next(server, v1):
    server.add_pod("default", "p1", "node-a")
    server.fail_next("GET", r"/pods$", status=503)
    with pytest.raises(client.ApiException) as e:
        v1.list_pod_for_all_namespaces()
    assert e.value.status == 503
    assert len(v1.list_pod_for_all_namespaces().items) == 1  # count=1: once only

    server.fail_next("GET", r"/pods$", status=500, watch=True)
    assert len(v1.list_pod_for_all_namespaces().items) == 1  # not a watch: untouched
    with pytest.raises(client.ApiException) as e:
        list(watch.Watch().stream(v1.list_pod_for_all_namespaces, timeout_seconds=1))
    assert e.value.status == 500

    # A PATCH that outlives its timeout raises, and the server still applies it.
    server.delay_next("PATCH", r"/pods/p1$", 1.0)
    body = {"metadata": {"annotations": {"late": "yes"}}}
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        v1.patch_namespaced_pod("p1", "default", body, _request_timeout=0.5)
    deadline = time.monotonic() + 5
    while "annotations" not in server.pod("default", "p1")["metadata"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # urllib3 retries a timed-out GET by default (Retry(3)): one slow answer goes unseen.
    server.delay_next("GET", r"/pods$", 1.0)
    assert len(v1.list_pod_for_all_namespaces(_request_timeout=0.5).items) == 1
    server.delay_next("GET", r"/pods$", 1.0, count=4)
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        v1.list_pod_for_all_namespaces(_request_timeout=0.3)


def test_auth_and_http_errors(server, v1, tmp_path):
    server.add_pod("default", "p1", "node-a")
    anonymous = client.CoreV1Api(make_api(server, tmp_path, token=False))
    with pytest.raises(client.ApiException) as e:
        anonymous.list_pod_for_all_namespaces()
    assert e.value.status == 401

    http = urllib3.PoolManager()
    auth = {"Authorization": f"Bearer {server.token}"}
    r = http.request("GET", f"{server.url}/api/v1/widgets", headers=auth)
    assert r.status == 404 and r.json()["kind"] == "Status"
    r = http.request("POST", f"{server.url}/api/v1/pods", headers=auth, body=b"{}")
    assert r.status == 405 and r.json()["reason"] == "MethodNotAllowed"
    headers = auth | {"Content-Type": "application/apply-patch+yaml"}
    r = http.request(
        "PATCH", f"{server.url}/api/v1/namespaces/default/pods/p1", headers=headers, body=b"{}"
    )
    assert r.status == 415
    r = http.request("GET", f"{server.url}/api/v1/pods", headers=auth)
    assert "kind" not in r.json()["items"][0]  # list items go without kind on the wire


def test_self_subject_access_reviews(server, tmp_path):
    authz = client.AuthorizationV1Api(make_api(server, tmp_path))

    def can_i(verb, resource, subresource=None, name=None):
        attributes = client.V1ResourceAttributes(
            verb=verb, resource=resource, subresource=subresource, name=name
        )
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes)
        )
        answer = authz.create_self_subject_access_review(review)
        assert answer.spec.resource_attributes.verb == verb  # the spec comes back
        return answer.status.allowed

    assert can_i("delete", "secrets")  # default: everything allowed
    server.rbac_allowed = {("pods", "list"), ("nodes/status", "patch")}
    assert can_i("list", "pods")
    assert not can_i("watch", "pods")
    assert can_i("patch", "nodes", "status", name="node-a")
    assert not can_i("patch", "nodes", name="node-a")  # the main resource is another rule
    assert not can_i("get", "nodes")
    assert server.requests[-1][:2] == (
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
    )

    http = urllib3.PoolManager()
    auth = {"Authorization": f"Bearer {server.token}"}
    r = http.request("POST", server.url + "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                     headers=auth, body=b'{"spec": {}}')  # fmt: skip
    assert r.status == 422 and "exactly one of" in r.json()["message"]
    r = http.request("POST", server.url + "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                     body=b'{"spec": {"resourceAttributes": {"verb": "get"}}}')  # fmt: skip
    assert r.status == 401


def test_node_with_address_and_annotations(server, v1):
    server.add_node("node-b", annotations={"example.com/x": "1"}, address="192.168.0.72")
    node = v1.read_node("node-b")
    assert node.metadata.annotations["example.com/x"] == "1"
    assert node.metadata.annotations["node.alpha.kubernetes.io/ttl"] == "0"  # kept
    internal = [a.address for a in node.status.addresses if a.type == "InternalIP"]
    assert internal == ["192.168.0.72"]


def test_stop_breaks_watches_and_restart_keeps_data(server, v1):
    server.add_pod("default", "p1", "node-a")
    url = server.url
    threading.Timer(0.3, server.stop).start()
    seen = []

    def follow():
        for ev in watch.Watch().stream(v1.list_pod_for_all_namespaces, timeout_seconds=30):
            seen.append(ev["type"])

    with pytest.raises(urllib3.exceptions.ProtocolError):
        follow()
    assert seen == ["ADDED"]
    with pytest.raises(urllib3.exceptions.MaxRetryError):  # connection refused
        v1.list_pod_for_all_namespaces(_request_timeout=1)

    rv = server.resource_version
    server.restart()
    assert server.url == url
    pods = v1.list_pod_for_all_namespaces()
    assert [p.metadata.name for p in pods.items] == ["p1"]
    assert pods.metadata.resource_version == str(rv)
    server.add_pod("default", "p2", "node-a")
    events = watch.Watch().stream(
        v1.list_pod_for_all_namespaces, resource_version=str(rv), timeout_seconds=1
    )
    assert [e["object"].metadata.name for e in events] == ["p2"]
    server.restart(compact=True)  # a restarted API server has a fresh watch cache
    with pytest.raises(client.ApiException) as e:
        list(
            watch.Watch().stream(
                v1.list_pod_for_all_namespaces, resource_version=str(rv), timeout_seconds=1
            )
        )
    assert e.value.status == 410


def test_drop_watches_ends_cleanly_and_the_client_resumes(server, v1):
    server.add_pod("default", "p1", "node-a")
    rv = v1.list_pod_for_all_namespaces().metadata.resource_version
    threading.Timer(0.3, server.drop_watches).start()
    started = time.monotonic()
    assert list(watch.Watch().stream(v1.list_pod_for_all_namespaces, timeout_seconds=30)) != []
    assert time.monotonic() - started < 5  # ended by drop_watches, not by its timeout

    server.requests.clear()
    modified = threading.Event()

    def watches():
        return [q for m, _, q in list(server.requests) if m == "GET" and q.get("watch")]

    def wait_for(predicate):
        deadline = time.monotonic() + 10
        while not predicate():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def changes():
        wait_for(lambda: len(watches()) == 1)  # the client is watching
        server.set_pod_phase("default", "p1", "Running")
        assert modified.wait(10)  # ...and saw it
        server.drop_watches()
        wait_for(lambda: len(watches()) == 2)  # it resumed with a new watch
        server.delete_pod("default", "p1")

    threading.Thread(target=changes).start()
    w = watch.Watch()
    seen = []
    for ev in w.stream(v1.list_pod_for_all_namespaces, resource_version=rv):
        seen.append(ev["type"])
        if ev["type"] == "MODIFIED":
            modified.set()
        if ev["type"] == "DELETED":
            w.stop()
    assert seen == ["MODIFIED", "DELETED"]
    # Without timeout_seconds the client watches again from the last RV it saw.
    modified_rv = str(int(rv) + 1)
    assert [q.get("resourceVersion") for q in watch_requests(server)] == [rv, modified_rv]


def test_bookmarks(server, v1):
    server.bookmark_interval = 0.2
    server.add_pod("default", "p1", "node-a")
    w = watch.Watch()
    seen = []
    for ev in w.stream(
        v1.list_pod_for_all_namespaces, allow_watch_bookmarks=True, timeout_seconds=5
    ):
        seen.append(ev["type"])
        if ev["type"] == "BOOKMARK":
            w.stop()
    assert seen == ["ADDED", "BOOKMARK"]
    assert w.resource_version == str(server.resource_version)


# ---- what kubectl needs besides the objects (tests/kubectl runs the real kubectl) ----

TABLE_ACCEPT = (  # what `kubectl get` sends without -o
    "application/json;as=Table;v=v1;g=meta.k8s.io,"
    "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"
)


def test_anonymous_requests_served_only_when_allowed(server):
    """kubectl sends no token over plain HTTP: ``anonymous = True`` serves it; a wrong
    token is refused either way."""
    http = urllib3.PoolManager()
    url = server.url + "/api/v1/nodes"
    assert http.request("GET", url).status == 401
    server.anonymous = True
    assert http.request("GET", url).status == 200
    assert http.request("GET", url, headers={"Authorization": "Bearer wrong"}).status == 401
    good = {"Authorization": f"Bearer {server.token}"}
    assert http.request("GET", url, headers=good).status == 200


def test_bearer_scheme_is_case_insensitive_as_in_kube_apiserver(server):
    """The in-cluster loader of the official client sends ``bearer <token>``: the real API
    server takes the scheme in any case (RFC 7235), so does the test server; the token
    itself must match exactly."""
    http = urllib3.PoolManager()
    url = server.url + "/api/v1/nodes"
    for scheme in ("bearer", "BEARER", "Bearer"):
        auth = {"Authorization": f"{scheme} {server.token}"}
        assert http.request("GET", url, headers=auth).status == 200, scheme
    for wrong in (f"Basic {server.token}", f"bearer {server.token.upper()}x", "bearer"):
        assert http.request("GET", url, headers={"Authorization": wrong}).status == 401, wrong


def test_discovery_read_by_the_official_client(server, tmp_path):
    """/version, /api, /apis, /apis/<group> and the APIResourceLists: what kubectl reads
    before any request for an object, deserialised into the client's typed models."""
    api = make_api(server, tmp_path)
    version = client.VersionApi(api).get_code()
    assert (version.major, version.minor, version.git_version) == ("1", "30", "v1.30.2")
    assert client.CoreApi(api).get_api_versions().versions == ["v1"]
    groups = client.ApisApi(api).get_api_versions().groups
    assert {g.name: g.preferred_version.group_version for g in groups} == {
        "events.k8s.io": "events.k8s.io/v1",
        "authorization.k8s.io": "authorization.k8s.io/v1",
        "resource.k8s.io": "resource.k8s.io/v1",
    }
    assert client.EventsApi(api).get_api_group().name == "events.k8s.io"
    core = {r.name: r for r in client.CoreV1Api(api).get_api_resources().resources}
    assert set(core) == {"pods", "pods/status", "pods/binding", "nodes", "nodes/status", "events"}
    assert (core["nodes"].kind, core["nodes"].namespaced, core["nodes"].short_names) == (
        "Node",
        False,
        ["no"],
    )
    assert core["pods"].namespaced and "watch" in core["pods"].verbs
    assert core["pods/binding"].verbs == ["create"]
    events = client.EventsV1Api(api).get_api_resources()
    assert events.group_version == "events.k8s.io/v1"
    assert [r.name for r in events.resources] == ["events"]
    reviews = client.AuthorizationV1Api(api).get_api_resources().resources
    assert [(r.name, r.verbs) for r in reviews] == [("selfsubjectaccessreviews", ["create"])]
    http = urllib3.PoolManager()
    auth = {"Authorization": f"Bearer {server.token}"}
    assert "apiVersion" not in http.request("GET", server.url + "/api/v1", headers=auth).json()
    assert http.request("GET", server.url + "/apis/apps/v1", headers=auth).status == 404
    assert http.request("GET", server.url + "/apis/apps", headers=auth).status == 404
    api.close()


def test_table_output_for_kubectl_get(server):
    """An Accept header preferring a meta.k8s.io Table gets one for pods, nodes and events
    (lists and single objects); plain JSON otherwise, and for anything else."""
    server.add_node("node-a", labels={"node-role.kubernetes.io/gpu": ""})
    server.add_pod("default", "running", "node-a", phase="Running")
    server.add_pod("default", "pending", "node-a", containers=[{"name": "a"}, {"name": "b"}])
    http = urllib3.PoolManager()
    auth = {"Authorization": f"Bearer {server.token}"}
    table = auth | {"Accept": TABLE_ACCEPT}

    nodes = http.request("GET", server.url + "/api/v1/nodes?limit=500", headers=table).json()
    assert (nodes["kind"], nodes["apiVersion"]) == ("Table", "meta.k8s.io/v1")
    assert nodes["metadata"]["resourceVersion"] == str(server.resource_version)
    columns = [c["name"] for c in nodes["columnDefinitions"] if c["priority"] == 0]
    assert columns == ["Name", "Status", "Roles", "Age", "Version"]
    [row] = nodes["rows"]
    assert row["cells"][:5] == ["node-a", "Ready", "gpu", row["cells"][3], "v1.30.2"]
    assert row["cells"][5:7] == ["10.0.0.11", "<none>"]  # -o wide: internal, external IP
    assert row["cells"][3].endswith("s")  # age in seconds
    assert row["object"]["kind"] == "PartialObjectMetadata"
    assert row["object"]["metadata"] == server.node("node-a")["metadata"]

    pods = http.request("GET", server.url + "/api/v1/namespaces/default/pods", headers=table)
    cells = {r["cells"][0]: r["cells"][1:4] for r in pods.json()["rows"]}
    assert cells == {"pending": ["0/2", "ContainerCreating", 0], "running": ["1/1", "Running", 0]}
    one = http.request("GET", server.url + "/api/v1/namespaces/default/pods/running", headers=table)
    assert one.json()["kind"] == "Table" and len(one.json()["rows"]) == 1
    beta = auth | {"Accept": "application/json;as=Table;v=v1beta1;g=meta.k8s.io"}
    r = http.request("GET", server.url + "/api/v1/nodes", headers=beta)
    assert r.json()["apiVersion"] == "meta.k8s.io/v1beta1"

    event = {"metadata": {"name": "e1"}, "involvedObject": {"kind": "Pod", "name": "running"}}
    event |= {"reason": "GPUShareRefused", "type": "Warning", "message": "no card", "count": 2}
    event |= {"lastTimestamp": "2024-01-01T00:00:00Z", "source": {"component": "gpushare"}}
    r = http.request("POST", server.url + "/api/v1/namespaces/default/events",
                     headers=auth, json=event)  # fmt: skip
    assert r.status == 201
    events = http.request("GET", server.url + "/api/v1/events", headers=table).json()
    [row] = events["rows"]
    assert row["cells"][1:4] == ["Warning", "GPUShareRefused", "pod/running"]
    assert row["cells"][5:7] == ["gpushare", "no card"] and row["cells"][8] == 2

    plain = http.request("GET", server.url + "/api/v1/nodes/node-a", headers=auth).json()
    assert plain == server.node("node-a")  # no Accept header: the object
    json_first = auth | {"Accept": "application/json, */*"}
    r = http.request("GET", server.url + "/api/v1/nodes", headers=json_first)
    assert r.json()["kind"] == "NodeList"
    r = http.request("GET", server.url + "/version", headers=table)
    assert r.json()["gitVersion"] == "v1.30.2"  # not a Table: as it is
    r = http.request("GET", server.url + "/api/v1/nodes/nope", headers=table)
    assert r.status == 404 and r.json()["kind"] == "Status"


@pytest.mark.parametrize(
    ("seconds", "age"),
    [(-5, "<invalid>"), (0, "0s"), (119, "119s"), (125, "2m5s"), (600, "10m"),
     (3 * 3600 + 60, "3h1m"), (30 * 3600, "30h"), (3 * 86400 + 4 * 3600, "3d4h"),
     (20 * 86400, "20d"), (3 * 365 * 86400 + 86400, "3y1d"), (9 * 365 * 86400, "9y")],
)  # fmt: skip
def test_human_age_as_kubectl_prints_it(seconds, age):
    from standins.apiserver_sim import human_age

    now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    created = (now - datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert human_age(created, now) == age


def test_connections_are_served_with_tcp_nodelay(server, v1):
    """Every accepted connection has TCP_NODELAY, as kube-apiserver's (Go sets it on every
    TCP connection): without it a response body, written after its headers, waits out the
    client's delayed ACK, and a benchmark would time the stand-in's Nagle stalls."""
    import socket

    v1.list_namespaced_pod("default")  # the client keeps its connection open (keep-alive)
    with server._cond:
        conns = list(server._conns)
    assert conns, "no connection held open after a request"
    assert all(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in conns)


# ---- resource.k8s.io/v1 (DRA) ----

DRIVER = "gpushare.aliyun.com"


def dra_slice(node="node-a", memory="16384Mi", name=None) -> dict:
    policy = {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}
    device = {
        "name": "gpu-0",
        "allowMultipleAllocations": True,
        "attributes": {"index": {"int": 0}},
        "capacity": {"memory": {"value": memory, "requestPolicy": policy}},
    }
    spec = {"driver": DRIVER, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "nodeName": node, "devices": [device]}  # fmt: skip
    return {"metadata": {"name": name or f"{node}-{DRIVER}"}, "spec": spec}


@pytest.fixture
def resource(server, tmp_path):
    api = make_api(server, tmp_path)
    yield client.ResourceV1Api(api)
    api.close()


def test_resource_v1_discovery(server, resource):
    """/apis/resource.k8s.io/v1 lists the four kinds (deletecollection among the verbs)
    and the claims' status subresource."""
    found = {r.name: r for r in resource.get_api_resources().resources}
    assert set(found) == {
        "deviceclasses",
        "resourceclaims",
        "resourceclaims/status",
        "resourceclaimtemplates",
        "resourceslices",
    }
    assert not found["resourceslices"].namespaced and found["resourceclaims"].namespaced
    assert "deletecollection" in found["resourceslices"].verbs


def test_resource_slices_through_the_client(server, resource):
    """A slice created through the client is stored with canonical quantities (16384Mi
    reads back 16Gi); lists and watches select by spec.nodeName; deletecollection with
    that selector wipes one node's slices only (what kubelet does at start)."""
    created = resource.create_resource_slice(dra_slice())
    assert created.spec.devices[0].capacity["memory"].value == "16Gi"
    resource.create_resource_slice(dra_slice("node-b"))
    mine = resource.list_resource_slice(field_selector="spec.nodeName=node-a")
    assert [s.metadata.name for s in mine.items] == [f"node-a-{DRIVER}"]
    events = watch.Watch().stream(
        resource.list_resource_slice,
        field_selector=f"spec.driver={DRIVER},spec.pool.name=node-b",
        timeout_seconds=1,
    )
    assert [(e["type"], e["object"].spec.node_name) for e in events] == [("ADDED", "node-b")]
    resource.delete_collection_resource_slice(field_selector="spec.nodeName=node-a")
    assert [s["spec"]["nodeName"] for s in server.resource_slices()] == ["node-b"]


def test_invalid_slices_are_refused_like_the_real_server(server, resource):
    """An invalid slice: 422, reason Invalid, one cause per field with its path; a
    quantity that does not parse: 400 before validation. Nothing is stored."""
    bad = dra_slice()
    bad["spec"]["devices"][0]["name"] = "GPU_0"
    bad["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["default"] = "1536Mi"
    with pytest.raises(client.ApiException) as raised:
        resource.create_resource_slice(bad)
    body = json.loads(raised.value.body)
    assert (raised.value.status, body["reason"]) == (422, "Invalid")
    fields = [c["field"] for c in body["details"]["causes"]]
    assert fields == [
        "spec.devices[0].name",
        "spec.devices[0].capacity[memory].requestPolicy.validRange.step",
    ]
    assert body["message"].startswith(
        f'ResourceSlice.resource.k8s.io "node-a-{DRIVER}" is invalid: ['
    )
    unparsable = dra_slice()
    unparsable["spec"]["devices"][0]["capacity"]["memory"]["value"] = "16 GB"
    with pytest.raises(client.ApiException) as raised:
        resource.create_resource_slice(unparsable)
    assert raised.value.status == 400
    assert (
        "quantities must match the regular expression" in json.loads(raised.value.body)["message"]
    )
    assert server.resource_slices() == []


def test_resource_claims_status_and_immutability(server, resource):
    """A claim is created without status (the body's is dropped) and with its request
    defaults; allocate_claim writes the allocation through the status subresource; a
    status patch through the client adds to reservedFor; an update of the main resource
    keeps the status; a changed spec is refused (422)."""
    server.add_device_class(DRIVER, [f'device.driver == "{DRIVER}"'])
    resource.create_resource_slice(dra_slice())
    body = {
        "metadata": {"name": "c"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER, "capacity": {"requests": {"memory": "3072Mi"}}}}]}},
        "status": {"reservedFor": [{"resource": "pods", "name": "x", "uid": "x"}]},
    }  # fmt: skip
    claim = resource.create_namespaced_resource_claim("ns", body)
    assert claim.status is None or not claim.status.reserved_for
    exact = claim.spec.devices.requests[0].exactly
    assert (exact.allocation_mode, exact.count, exact.capacity.requests["memory"]) == (
        "ExactCount",
        1,
        "3Gi",
    )
    pod = server.add_pod("ns", "p", "node-a")
    stored = server.allocate_claim("ns", "c", "node-a", pod)
    [result] = stored["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": "3Gi"}
    reserved = [{"resource": "pods", "name": "q", "uid": "uid-q"}]
    patched = resource.patch_namespaced_resource_claim_status(
        "c", "ns", {"status": {"reservedFor": reserved}}
    )
    assert [r.name for r in patched.status.reserved_for] == ["p", "q"]  # merged by uid
    current = server.resource_claim("ns", "c")
    current["status"] = {}
    kept = resource.replace_namespaced_resource_claim("c", "ns", current)
    assert kept.status.allocation is not None
    current["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    with pytest.raises(client.ApiException) as raised:
        resource.replace_namespaced_resource_claim("c", "ns", current)
    assert raised.value.status == 422
    assert json.loads(raised.value.body)["details"]["causes"][0]["field"] == "spec"
    resource.delete_namespaced_resource_claim("c", "ns")
    assert server.resource_claim("ns", "c") is None


def test_device_classes_and_claim_templates(server, resource):
    """Classes and templates are stored and listed; a template's inner spec is checked
    like a claim's."""
    resource.create_device_class({"metadata": {"name": DRIVER}, "spec": {"selectors": [
        {"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}})  # fmt: skip
    assert [c.metadata.name for c in resource.list_device_class().items] == [DRIVER]
    template = {"metadata": {"name": "t"}, "spec": {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}}}  # fmt: skip
    resource.create_namespaced_resource_claim_template("ns", template)
    listed = resource.list_namespaced_resource_claim_template("ns").items
    assert listed[0].spec.spec.devices.requests[0].exactly.count == 1
    template["metadata"]["name"] = "t2"
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = ""
    with pytest.raises(client.ApiException) as raised:
        resource.create_namespaced_resource_claim_template("ns", template)
    assert raised.value.status == 422
