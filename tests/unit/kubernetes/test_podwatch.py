"""Pins nodemgr.kubernetes.podwatch: a pod from the API as PodInfo (raw JSON and V1Pod;
extended resources only, a limit standing in for a missing request, whole-number
quantities); and, against the test API server (standins/apiserver_sim.py), the
cache of this node's pods: filled from one LIST (field selector spec.nodeName) and kept by
a WATCH of ADDED/MODIFIED/DELETED; the candidate index per event, and the index of
candidates by what they ask ((resource, size) -> pods), always the candidates filtered by
podmatch.asked_sizes, over random event sequences and re-LISTs; a clean watch end
resumes without a LIST, an expired one (410) or a server whose versions went back lists
again; ``abort`` ends a blocked read at once and nothing changes after a stop. The
extender's choice as the trust reads it: a pod owner's unsigned annotations choose
nothing and are reported once (per reason), a signed placement is believed, and no
annotation content (deep nesting, huge numbers) raises in the LIST, an event or the
match."""

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.client import V1Pod

from nodemgr.common.placementkey import read_private_key
from nodemgr.config.schema import KubernetesSettings
from nodemgr.domain.extenderchoice import (
    PlacementTrust,
    signed_message,
    signed_text,
    with_signature,
)
from nodemgr.domain.podmatch import (
    ContainerRequest,
    asked_sizes,
    find_demand,
    is_candidate_pod,
    parse_extender_index,
)
from nodemgr.kubernetes.client import ApiSession, find_credentials, new_api_client
from nodemgr.kubernetes.podwatch import (
    PodWatch,
    extended_requests,
    is_extended_resource,
    placement_trust,
    pod_info,
)
from nodemgr.kubernetes.writes import Backoff
from standins import placementkeys
from standins.apiserver_sim import TestApiServer
from tests.unit.kubernetes.support import (
    CORE,
    MEM,
    NODE,
    TIMEOUT_SECONDS,
    names,
    requests_of,
    wait_until,
)


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


# --- pods from the API -----------------------------------------------------------------


def test_pod_info_from_raw_json():
    """A pod as raw JSON: identity, phase, creation time, annotations, and per container
    its integer extended-resource requests only (a limit standing in for a missing request)."""
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
    """A V1Pod model reads exactly as the same pod in raw JSON."""
    assert pod_info(V1Pod.from_dict(raw_pod())) == pod_info(raw_pod())


def test_pod_info_deleting_and_defaults():
    """A deletionTimestamp means deleting; no status yet means Pending; missing fields
    read as empty, never as an error."""
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
    """Extended resources are <domain>/<name> outside kubernetes.io; quota names are not."""
    assert is_extended_resource(name) is extended


def test_extended_requests_quantities():
    """The request wins over the limit, "1k" is 1000, a fraction or garbage is no request."""
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


# --- the watch, against the test API server ------------------------------------------


@pytest.fixture
def make_watch(api, tmp_path):
    made = []
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")

    def make(candidate=None, start=True, trust=None, on_ignored=None):
        client = new_api_client(find_credentials(kubeconfig, environ={}))
        session = ApiSession(client, TIMEOUT_SECONDS, time.time)
        stop = threading.Event()
        watch = PodWatch(
            session,
            NODE,
            stop,
            backoff=Backoff(0.05, 0.4),
            candidate=candidate,
            trust=trust,
            on_ignored=on_ignored,
        )
        watch.stop = stop
        made.append((watch, session))
        if start:
            watch.thread.start()
            wait_until(lambda: watch.synced, what="initial LIST")
            wait_until(lambda: watch.watching, what="WATCH")
        return watch

    yield make
    for watch, session in made:
        watch.stop.set()
        watch.abort()
        if watch.thread.is_alive():
            watch.thread.join(2.0)
        session.close()


def test_cache_lists_then_follows_this_nodes_pods(api, make_watch):
    """One LIST and one WATCH with the field selector of this node (the WATCH from the
    LIST's version); ADDED/MODIFIED/DELETED of this node's pods follow, other nodes'
    pods never arrive, and there is no second LIST."""
    api.add_pod(
        "ml",
        "train-0",
        NODE,
        containers=[{"name": "main", "requests": {MEM: "4", CORE: "30"}}],
        init_containers=[{"name": "init", "requests": {MEM: "1"}}],
    )
    api.add_pod("ml", "elsewhere", "node-b")
    watch = make_watch()
    assert names(watch) == ["ml/train-0"]
    info = watch.pod("ml", "train-0")
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

    generation = watch.generation
    api.add_pod("ml", "train-1", NODE)
    assert watch.wait_for_change(generation, 5.0) > generation
    wait_until(lambda: names(watch) == ["ml/train-0", "ml/train-1"], what="ADDED")
    api.update_pod(
        "ml", "train-0", lambda p: p["metadata"].setdefault("annotations", {}).update(x="1") or p
    )
    wait_until(lambda: watch.pod("ml", "train-0").annotations.get("x") == "1", what="MODIFIED")
    api.delete_pod("ml", "train-1", graceful=True)
    wait_until(lambda: watch.pod("ml", "train-1").deleting, what="terminating")
    api.delete_pod("ml", "train-1")
    wait_until(lambda: names(watch) == ["ml/train-0"], what="DELETED")
    api.add_pod("ml", "elsewhere-2", "node-b")
    api.set_pod_phase("ml", "train-0", "Running")
    wait_until(lambda: watch.pod("ml", "train-0").phase == "Running", what="phase")
    assert names(watch) == ["ml/train-0"]  # node-b's pods never arrive
    assert len(requests_of(api, "GET", r"^/api/v1/pods$", watch=False)) == 1  # no relist


def test_candidate_index_follows_events_without_walking_the_cache(api, make_watch):
    """The candidate index (pending pods asking for a shared GPU) is kept per event: a pod
    enters it when added, leaves it when admitted (Running) or deleted."""
    api.add_pod("ml", "pending-gpu", NODE, containers=[{"name": "m", "requests": {MEM: "2"}}])
    api.add_pod("ml", "running-gpu", NODE, phase="Running")
    api.add_pod("ml", "pending-cpu", NODE, containers=[{"name": "m", "requests": {"cpu": "1"}}])
    watch = make_watch(candidate=lambda pod: is_candidate_pod(pod, (MEM, CORE)))

    def candidates():
        return sorted(p.name for p in watch.candidates())

    assert candidates() == ["pending-gpu"]  # from the LIST
    api.add_pod("ml", "new-gpu", NODE, containers=[{"name": "m", "requests": {CORE: "20"}}])
    wait_until(lambda: candidates() == ["new-gpu", "pending-gpu"], what="ADDED candidate")
    api.set_pod_phase("ml", "pending-gpu", "Running")
    wait_until(lambda: candidates() == ["new-gpu"], what="admitted pod leaves the index")
    api.delete_pod("ml", "new-gpu")
    wait_until(lambda: candidates() == [], what="DELETED candidate")
    assert len(watch.pods()) == 3  # the cache itself still holds the other pods


def test_asking_index_follows_watch_events(api, make_watch):
    """Against the test API server: candidates_asking(resource, size) holds the pending
    pods some container (or init container) of which asks exactly that, and follows a
    changed request, Running, a deletionTimestamp, a DELETED and a move to another node."""
    api.add_pod(
        "ml",
        "a",
        NODE,
        containers=[{"name": "m", "requests": {MEM: "2", CORE: "30"}}],
        init_containers=[{"name": "i", "requests": {MEM: "1"}}],
    )
    api.add_pod("ml", "b", NODE, containers=[{"name": "m", "requests": {MEM: "2"}}])
    api.add_pod("ml", "cpu", NODE, containers=[{"name": "m", "requests": {"cpu": "1"}}])
    watch = make_watch(candidate=lambda pod: is_candidate_pod(pod, (MEM, CORE)))

    def asking(resource, size):
        return sorted(p.name for p in watch.candidates_asking(resource, size))

    assert (asking(MEM, 2), asking(MEM, 1), asking(CORE, 30)) == (["a", "b"], ["a"], ["a"])
    assert asking(MEM, 4) == [] and asking("cpu", 1) == []  # cpu is no extended resource

    def ask(size):
        def change(p):
            p["spec"]["containers"][0]["resources"] = {
                "requests": {MEM: size},
                "limits": {MEM: size},
            }

        return change

    api.update_pod("ml", "b", ask("4"))  # the request changed: old bucket left, new entered
    wait_until(lambda: asking(MEM, 4) == ["b"], what="MODIFIED request")
    assert asking(MEM, 2) == ["a"]
    api.set_pod_phase("ml", "a", "Running")
    wait_until(lambda: asking(CORE, 30) == [], what="admitted pod leaves its buckets")
    assert asking(MEM, 2) == [] and asking(MEM, 1) == []
    api.add_pod("ml", "c", NODE, containers=[{"name": "m", "requests": {MEM: "4"}}])
    wait_until(lambda: asking(MEM, 4) == ["b", "c"], what="ADDED")
    api.delete_pod("ml", "b", graceful=True)
    wait_until(lambda: asking(MEM, 4) == ["c"], what="terminating pod leaves")
    api.update_pod("ml", "c", lambda p: p["spec"].update(nodeName="node-b"))
    wait_until(lambda: asking(MEM, 4) == [], what="moved to another node")
    api.add_pod("ml", "d", NODE, containers=[{"name": "m", "requests": {CORE: "30"}}])
    wait_until(lambda: asking(CORE, 30) == ["d"], what="ADDED")
    api.delete_pod("ml", "d")
    wait_until(lambda: asking(CORE, 30) == [], what="DELETED")


PHASES = ("Pending", "Pending", "Running", "Succeeded")
REQUEST = st.dictionaries(st.sampled_from([MEM, CORE, "example.com/nic"]), st.integers(0, 3))


def event_pod(name, node, phase, deleting, containers, init):
    def spec(requests, i):
        return {
            "name": f"c{i}",
            "resources": {"requests": {k: str(v) for k, v in requests.items()}},
        }

    metadata = {"namespace": "ml", "name": name, "creationTimestamp": "2024-01-02T03:04:05Z"}
    if deleting:
        metadata["deletionTimestamp"] = "2024-01-02T03:05:00Z"
    return {
        "metadata": metadata,
        "spec": {
            "nodeName": node,
            "containers": [spec(r, i) for i, r in enumerate(containers)],
            "initContainers": [spec(r, i) for i, r in enumerate(init)],
        },
        "status": {"phase": phase},
    }


EVENT_POD = st.builds(
    event_pod,
    st.sampled_from("abcde"),
    st.sampled_from([NODE, NODE, NODE, "node-b"]),
    st.sampled_from(PHASES),
    st.booleans(),
    st.lists(REQUEST, max_size=2),
    st.lists(REQUEST, max_size=1),
)
EVENT = st.one_of(
    st.tuples(st.sampled_from(["ADDED", "MODIFIED", "MODIFIED", "DELETED"]), EVENT_POD),
    st.tuples(
        st.just("LIST"),
        st.lists(EVENT_POD.filter(lambda p: p["spec"]["nodeName"] == NODE), max_size=4),
    ),
)
ASKS = [(resource, size) for resource in (MEM, CORE, "example.com/nic") for size in range(5)]


def test_asking_index_is_the_candidates_filtered_by_what_they_ask(api, make_watch):
    """Over random sequences of ADDED/MODIFIED/DELETED events (requests, phase, deletion,
    another node) and re-LISTs fed to the watch's handler: after each, every bucket
    candidates_asking(resource, size) holds exactly the candidates whose asked_sizes contain
    (resource, size), and a snapshot a reader took before the event is left as it was."""
    watch = make_watch(candidate=lambda pod: is_candidate_pod(pod, (MEM, CORE)), start=False)

    def keys(pods):  # the PodInfos themselves (a stale one differs), in a fixed order
        return sorted(pods, key=lambda p: (p.namespace, p.name))

    def check():
        for resource, size in ASKS:
            expected = [p for p in watch.candidates() if (resource, size) in asked_sizes(p)]
            found = watch.candidates_asking(resource, size)
            assert isinstance(found, tuple)  # a snapshot, not a view of the index
            assert keys(found) == keys(expected), (resource, size)

    @settings(max_examples=150, deadline=None)
    @given(events=st.lists(EVENT, max_size=12))
    def run(events):
        watch.replace(iter(()))
        for version, (kind, obj) in enumerate(events):
            taken = {ask: watch.candidates_asking(*ask) for ask in ASKS}
            before = {ask: keys(pods) for ask, pods in taken.items()}
            if kind == "LIST":
                watch.replace(iter(obj))
            else:
                obj["metadata"]["resourceVersion"] = str(version)
                watch.apply(kind, obj)
            check()
            assert {ask: keys(pods) for ask, pods in taken.items()} == before  # copy on write

    run()


def test_relist_after_expired_watch(api, make_watch):
    """A watch resumed from a compacted version (410) lists again, sees what happened
    meanwhile, and watches again."""
    api.add_pod("ml", "old", NODE)
    watch = make_watch()
    assert names(watch) == ["ml/old"]
    # The watch ends; its resumption waits while the history is compacted
    # past the version the watch knows: the server answers 410 and the
    # watch must list again to see what happened meanwhile.
    api.delay_next("GET", r"^/api/v1/pods$", 0.5, watch=True)
    api.drop_watches()
    api.delete_pod("ml", "old")
    api.add_pod("ml", "new", NODE)
    api.compact()
    wait_until(lambda: names(watch) == ["ml/new"], what="relist")
    assert len(requests_of(api, "GET", r"^/api/v1/pods$", watch=False)) == 2
    assert watch.synced
    api.add_pod("ml", "newer", NODE)  # and it watches again
    wait_until(lambda: names(watch) == ["ml/new", "ml/newer"], what="watch after relist")


def test_relist_when_the_servers_versions_went_back(api, make_watch):
    """An API server restored from an older etcd (our version is ahead: 504 "too large
    resource version"): the cache is listed again from scratch."""
    api.add_pod("ml", "old", NODE)
    watch = make_watch()
    # An API server restored from an older etcd at the same address: the
    # watch's resourceVersion is ahead of it ("Too large resource version").
    api.stop()
    restored = TestApiServer(token=api.token)
    restored._port = api._port  # the same address (the simulator has no public knob for it)
    restored.start()
    try:
        restored.add_pod("ml", "restored", NODE)
        assert restored.resource_version < int(watch.pod("ml", "old").resource_version)
        wait_until(lambda: names(watch) == ["ml/restored"], what="relist")
        assert watch.synced
    finally:
        restored.stop()


def test_clean_watch_end_resumes_without_relist(api, make_watch):
    """The server ending a watch cleanly: a new WATCH from the last version, no LIST."""
    watch = make_watch()
    api.drop_watches()
    api.add_pod("ml", "p", NODE)
    wait_until(lambda: names(watch) == ["ml/p"], what="resumed watch")
    assert len(requests_of(api, "GET", r"^/api/v1/pods$", watch=False)) == 1
    assert len(requests_of(api, "GET", r"^/api/v1/pods$", watch=True)) >= 2


def test_abort_ends_a_blocked_read_at_once(api, make_watch):
    """A quiet watch stream blocks in a read; stop and abort end the thread at once,
    not at the watch's timeout."""
    watch = make_watch()
    began = time.monotonic()
    watch.stop.set()
    watch.abort()
    watch.thread.join(2.0)
    assert not watch.thread.is_alive()
    assert time.monotonic() - began < 1.0
    assert watch.watching is False


def test_nothing_changes_after_stop(api, make_watch):
    """Once stopped the cache is frozen: an event or a LIST that lands late changes
    nothing (the allocator must not act on a cache being torn down)."""
    api.add_pod("ml", "before", NODE)
    watch = make_watch()
    generation = watch.generation
    watch.stop.set()
    watch.abort()
    watch.thread.join(2.0)
    watch._publish({}, synced=True)  # what a late LIST would do
    assert names(watch) == ["ml/before"]
    assert watch.generation == generation


def test_a_failing_server_is_retried_with_backoff_not_spun(api, make_watch):
    """A LIST answered 500 is tried again after a backoff, then the cache fills."""
    api.add_pod("ml", "p", NODE)
    api.fail_next("GET", r"^/api/v1/pods$", 500, count=2, watch=False)
    watch = make_watch(start=False)
    watch.thread.start()
    wait_until(lambda: watch.synced, what="LIST after the failures")
    assert names(watch) == ["ml/p"]
    assert len(requests_of(api, "GET", r"^/api/v1/pods$", watch=False)) == 3


# --- the extender's choice -------------------------------------------------------------


def test_owner_annotations_choose_nothing_and_are_reported_once(api, make_watch):
    """Under the default trust (signed, no key) a pending pod's own IDX/ASSUME_TIME choose
    no card and do not reorder the queue; the note is reported once for the LIST and not
    again for an event that leaves the reason unchanged, again when the reason changes."""
    owner = {
        "ALIYUN_COM_GPU_MEM_IDX": "1",
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1",
        "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
    }
    api.add_pod("ml", "owner", NODE, containers=[{"name": "m", "requests": {MEM: "4"}}],
                annotations=owner)  # fmt: skip
    reported = []
    watch = make_watch(on_ignored=reported.append)
    info = watch.pod("ml", "owner")
    assert info.choice is None and parse_extender_index(info, 0) is None
    assert info.admission_time == info.created_at  # ASSUME_TIME=1 does not make it oldest
    assert [p.name for p in reported] == ["owner"]
    assert "ALIYUN_COM_GPU_MEM_IDX, ALIYUN_COM_GPU_MEM_ASSUME_TIME on it are not signed" in (
        reported[0].choice_note
    )
    api.update_pod("ml", "owner", lambda p: p["metadata"]["annotations"].update(x="1") or p)
    wait_until(lambda: watch.pod("ml", "owner").annotations.get("x") == "1", what="MODIFIED")
    assert len(reported) == 1
    api.update_pod(
        "ml",
        "owner",
        lambda p: p["metadata"]["annotations"].update({"gpushare.aliyun.com/placement": "x"}) or p,
    )
    wait_until(lambda: len(reported) == 2, what="the new reason reported")
    assert "gpushare.aliyun.com/placement annotation is unreadable" in reported[1].choice_note


def test_a_signed_placement_is_believed(api, make_watch, tmp_path):
    """The extender's signature over this pod's UID and node: its card and assume time."""
    private, public = placementkeys.write_pair(str(tmp_path))
    key = read_private_key(private)
    stored = api.add_pod("ml", "signed", NODE, containers=[{"name": "m", "requests": {MEM: "4"}}])
    text = signed_text(stored["metadata"]["uid"], NODE, 7 * 10**9, {0: 1})
    api.update_pod(
        "ml",
        "signed",
        lambda p: (
            p["metadata"]
            .setdefault("annotations", {})
            .update(
                {
                    "gpushare.aliyun.com/placement": with_signature(
                        text, key.sign(signed_message(text))
                    )
                }
            )
            or p
        ),
    )
    trust = placement_trust(KubernetesSettings(placement_public_key=public))
    reported = []
    watch = make_watch(trust=trust, on_ignored=reported.append)
    wait_until(lambda: watch.pod("ml", "signed").choice is not None, what="the signed choice")
    info = watch.pod("ml", "signed")
    assert parse_extender_index(info, 0) == 1 and info.admission_time == 7.0
    assert reported == []


def test_unreadable_key_trusts_no_signature(tmp_path):
    """A key file that is no Ed25519 public key, or none at all: no verifier, and why."""
    (tmp_path / "placement.pub").write_text("not a key")
    trust = placement_trust(
        KubernetesSettings(placement_public_key=str(tmp_path / "placement.pub"))
    )
    assert trust.verifier is None
    assert "placement.pub is unusable" in trust.verifier_problem
    assert "exactly one PEM block" in trust.verifier_problem
    missing = placement_trust(KubernetesSettings(placement_public_key="/nonexistent/key.pub"))
    assert (
        missing.verifier is None and "/nonexistent/key.pub is unusable" in missing.verifier_problem
    )


@pytest.mark.parametrize("mode", ["signed", "annotations"])
def test_no_annotation_content_raises_in_the_list_the_watch_or_the_match(api, make_watch, mode):
    """A tenant's own pod with the allocation annotation nested 3,000 deep, a 5,000-digit
    assume time and a 100,000-digit index: the LIST and the events fill the cache, and the
    match for a victim asking the same size finds the victim's container."""
    hostile = {
        "scheduler.framework.gpushare.allocation": "[" * 3000 + "]" * 3000,
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1" * 5000,
        "ALIYUN_COM_GPU_MEM_IDX": "9" * 100_000,
    }
    api.add_pod("evil", "nested", NODE, containers=[{"name": "m", "requests": {MEM: "4"}}],
                annotations=hostile)  # fmt: skip
    watch = make_watch(trust=PlacementTrust(mode))
    assert names(watch) == ["evil/nested"]
    api.add_pod("evil", "nested-2", NODE, containers=[{"name": "m", "requests": {MEM: "4"}}],
                annotations=hostile)  # fmt: skip
    api.add_pod("team", "victim", NODE, containers=[{"name": "m", "requests": {MEM: "4"}}])
    wait_until(lambda: len(names(watch)) == 3, what="the events")
    pods = watch.pods()
    assert all(parse_extender_index(p, 0) is None for p in pods)
    found = find_demand(pods, MEM, 4, MEM, CORE, {})
    assert found is not None and found.extender_card_index is None
