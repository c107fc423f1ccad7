"""The extender's API edge against the test API server, with the official client:
nodemgr.kubernetes.listwatch (paged LIST + WATCH of the whole cluster) and
nodemgr.kubernetes.scheduling (the annotations patch and the Binding), and the test API
server's pods/binding and limit/continue paging they need.

Pins: a LIST is fetched in pages of page_size, from one snapshot, and handed over whole;
watch events follow; an expired version (410) gives one new LIST; pods are listed once
per (re)start, never per event; the Binding sets spec.nodeName and the PodScheduled
condition, refuses a pod already bound or a stale UID (409, KubeConflict) and a missing
pod (404); the merge patch changes only the keys given.
"""

from __future__ import annotations

import threading
import time

import pytest
from kubernetes.client.exceptions import ApiException

from nodemgr.errors import KubeConflict, KubeNotFound
from nodemgr.kubernetes import scheduling
from nodemgr.kubernetes.listwatch import ListWatch
from nodemgr.kubernetes.writes import Backoff
from standins.apiserver_sim import TestApiServer


@pytest.fixture
def api():
    server = TestApiServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def session(api, tmp_path):
    session = scheduling.open_session(api.write_kubeconfig(tmp_path / "kubeconfig"), 5.0)
    yield session
    session.close()


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []

    def replace(self, items):
        names = [obj["metadata"]["name"] for obj in items]  # fetches the pages
        with self.lock:
            self.lists.append(names)

    def apply(self, kind, obj):
        with self.lock:
            self.events.append((kind, obj["metadata"]["name"]))


def wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_paged_list_then_watch_then_a_relist_after_expiry(api, session):
    for i in range(5):
        api.add_pod("default", f"p{i}")
    recorder, stop = Recorder(), threading.Event()
    watch = ListWatch(session, "pods", recorder, stop, page_size=2, backoff=Backoff(0.05, 0.2))
    watch.start()
    try:
        wait(lambda: watch.watching)
        assert recorder.lists == [[f"p{i}" for i in range(5)]]
        lists = [q for m, p, q in api.requests if p == "/api/v1/pods" and q.get("watch") != "true"]
        assert [q.get("limit") for q in lists] == ["2", "2", "2"]
        assert "continue" in lists[1] and "continue" in lists[2]
        api.add_pod("default", "p5")
        api.delete_pod("default", "p0")
        wait(lambda: len(recorder.events) == 2)
        assert recorder.events == [("ADDED", "p5"), ("DELETED", "p0")]
        api.stop()  # while it is down, a change, and its history is compacted away
        api.add_pod("default", "p6")
        api.compact()
        api.start()  # the watch resumes from a version the history no longer has: 410
        wait(lambda: len(recorder.lists) == 2)
        assert recorder.lists[1] == [f"p{i}" for i in range(1, 7)]
        assert watch.lists == 2
    finally:
        stop.set()
        watch.abort()
        watch.thread.join(5)


def test_nodes_are_watched_too(api, session):
    api.add_node("node-a")
    recorder, stop = Recorder(), threading.Event()
    watch = ListWatch(session, "nodes", recorder, stop)
    watch.start()
    try:
        wait(lambda: watch.watching and watch.synced)
        api.add_node("node-b", annotations={"gpushare.aliyun.com/gpus": "{}"})
        wait(lambda: recorder.events == [("ADDED", "node-b")])
        assert recorder.lists == [["node-a"]]
    finally:
        stop.set()
        watch.abort()
        watch.thread.join(5)
    with pytest.raises(ValueError, match="resource must be one of"):
        ListWatch(session, "events", recorder, stop)


def test_binding_and_annotations(api, session):
    pod = api.add_pod("default", "job")
    uid = pod["metadata"]["uid"]
    scheduling.patch_pod_annotations(session, "default", "job", {"ALIYUN_COM_GPU_MEM_IDX": "1"})
    with pytest.raises(KubeConflict, match="UID in precondition"):
        scheduling.create_binding(session, "default", "job", "another-uid", "node-a")
    scheduling.create_binding(session, "default", "job", uid, "node-a")
    stored = api.pod("default", "job")
    assert stored["spec"]["nodeName"] == "node-a"
    assert stored["metadata"]["annotations"] == {"ALIYUN_COM_GPU_MEM_IDX": "1"}
    scheduled = [c for c in stored["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert [c["status"] for c in scheduled] == ["True"]
    with pytest.raises(KubeConflict, match='already assigned to node "node-a"'):
        scheduling.create_binding(session, "default", "job", uid, "node-b")
    with pytest.raises(KubeNotFound):
        scheduling.create_binding(session, "default", "ghost", "", "node-a")
    with pytest.raises(KubeNotFound):
        scheduling.patch_pod_annotations(session, "default", "ghost", {"a": "b"})


def test_an_event_on_a_pod(api, session):
    """create_event posts a core/v1 Warning Event on the pod (its UID for kubectl describe)."""
    pod = api.add_pod("team", "job")
    scheduling.create_event(
        session, "team", "job", pod["metadata"]["uid"], "GPUSharePlacementIgnored", "why", 3
    )
    (event,) = api.events()
    assert (event["reason"], event["message"], event["type"], event["count"]) == (
        "GPUSharePlacementIgnored",
        "why",
        "Warning",
        3,
    )
    assert event["involvedObject"]["uid"] == pod["metadata"]["uid"]
    assert event["source"] == {"component": "gpushare-scheduler"}


def test_the_simulator_checks_bindings_as_the_api_server_does(api, session):
    api.add_pod("default", "job")
    core = session.core
    for body, status in (
        ({"metadata": {"name": "other"}, "target": {"name": "n"}}, 400),
        ({"metadata": {"name": "job"}, "target": {"kind": "Pod", "name": "n"}}, 422),
        ({"metadata": {"name": "job"}, "target": {}}, 422),
    ):
        with pytest.raises(ApiException) as failure:
            core.create_namespaced_pod_binding("job", "default", body, _preload_content=False)
        assert failure.value.status == status
    api.delete_pod("default", "job")
    api.add_pod("default", "job")
    api.delete_pod("default", "job", graceful=True)
    with pytest.raises(KubeConflict, match="being deleted"):
        scheduling.create_binding(session, "default", "job", "", "n")
    # A continue token whose snapshot is gone: 410, as the real server answers.
    for i in range(3):
        api.add_pod("default", f"q{i}")
    first = session.call("list", "pods", core.list_pod_for_all_namespaces, limit=1)
    api.add_pod("default", "q9")
    api.compact()
    with pytest.raises(Exception, match="410"):
        session.call(
            "list",
            "pods",
            core.list_pod_for_all_namespaces,
            limit=1,
            _continue=first["metadata"]["continue"],
        )
