"""nodemgr.extender.server: the verbs over the cache, served over real HTTP.

The server runs in this process on a free loopback port, its cache fed by the watch
handlers directly and its binder a fake. Pins: filter answers in the form asked
(NodeNames or the full Nodes, passed back as received) with reasons per failed node;
prioritize scores every node; bind writes the gpushare annotations, then the Binding,
and counts the cards at once; a failed bind frees them, one without an answer keeps
them; concurrent binds to one node never give the same card space twice; until the
cache is listed, filter and bind answer with an Error and /healthz with 503 (on the
TLS port and on the plain probe port, which serves nothing else); /metrics is
Prometheus text; bad bodies get 400 naming the field, unknown paths 404, wrong methods
405; the URL prefix is optional. Every call here is made as kube-scheduler makes it:
over mutual TLS with the client of the rendered KubeSchedulerConfiguration.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from nodemgr.errors import KubeConflict, KubeUnavailable
from nodemgr.extender.cache import ClusterCache
from nodemgr.extender.server import Extender, ExtenderServer
from nodemgr.extender.tls import ServerTls, TlsFiles
from standins.extender_tls import TlsMaterial, https_request
from standins.gofmt import sprintf_no_args
from tests.unit.extender.support import (
    CORE,
    MEMORY,
    RESOURCES,
    SIGNING_KEY,
    WHOLE,
    annotation,
    cache_with,
    node,
    placed,
    pod,
)


class FakeBinder:
    def __init__(self):
        self.calls = []
        self.fail_bind = None
        self.lock = threading.Lock()

    def annotate(self, namespace, name, annotations):
        with self.lock:
            self.calls.append(("annotate", namespace, name, dict(annotations)))

    def bind(self, namespace, name, uid, node_name):
        if self.fail_bind is not None:
            raise self.fail_bind
        with self.lock:
            self.calls.append(("bind", namespace, name, uid, node_name))


NODES = [node("a", annotation((7, 80), (11, 10))), node("b", annotation((0, 0), (0, 0)))]


_MATERIAL: list[TlsMaterial] = []


def material() -> TlsMaterial:
    """One CA, server and client certificate (render.py tls) for the module's servers."""
    if not _MATERIAL:
        _MATERIAL.append(TlsMaterial())
    return _MATERIAL[0]


class Served:
    """The server in this process: its verbs over mutual TLS, as kube-scheduler calls them
    (the client from the rendered KubeSchedulerConfiguration), its probes on plain HTTP."""

    def __init__(self, cache, tls_files=None, tls_check_seconds=1.0, client_names=(), **options):
        self.binder = FakeBinder()
        self.extender = Extender(cache, self.binder, SIGNING_KEY, clock_ns=lambda: 42)
        self.tls = material()
        files = tls_files or TlsFiles.in_directory(self.tls.dir)
        self.server_tls = ServerTls(files, client_names, check_seconds=tls_check_seconds)
        self.server = ExtenderServer(
            self.extender,
            ("127.0.0.1", 0),
            "/gpushare-scheduler",
            tls=self.server_tls,
            health_address=("127.0.0.1", 0),
            **options,
        )
        self.server.start()
        self.url = f"https://127.0.0.1:{self.server.address[1]}"
        self.client = self.tls.client(self.url + "/gpushare-scheduler")
        self.health_url = f"http://127.0.0.1:{self.server.health_address[1]}"

    def request(self, method, path, body=None):
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        status, answer = https_request(self.client, method, path, data)
        return status, answer.decode()

    def health(self, method, path, body=None):
        request = urllib.request.Request(self.health_url + path, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, verb, body, prefix="/gpushare-scheduler"):
        status, text = self.request("POST", f"{prefix}/{verb}", body)
        assert status == 200, text
        return json.loads(text)

    def close(self):
        self.server.shutdown()


@pytest.fixture
def served():
    pods = [pod("job", ("main", {MEMORY: 6, CORE: 40}), uid="u-job")]
    s = Served(cache_with(NODES, pods))
    yield s
    s.close()


def test_filter_by_names_and_by_nodes(served):
    job = pod("job", ("main", {MEMORY: 6, CORE: 40}), uid="u-job")
    result = served.post("filter", {"Pod": job, "NodeNames": ["a", "b"]})
    assert result["NodeNames"] == ["b"] and result["Nodes"] is None and result["Error"] == ""
    assert result["FailedNodes"] == {
        "a": "no single GPU on a has 6 GiB and 40 percent free: GPU0 (Tesla T4) has "
        "8 GiB/20 percent free, GPU1 (Tesla T4) has 4 GiB/90 percent free"
    }
    result = served.post("filter", {"Pod": job, "Nodes": {"items": NODES}}, prefix="")
    assert result["Nodes"]["items"] == [NODES[1]] and result["NodeNames"] is None
    no_gpu = pod("web", ("main", {"cpu": 1}))
    assert served.post("filter", {"Pod": no_gpu, "NodeNames": ["a", "x"]})["NodeNames"] == [
        "a",
        "x",
    ]


def test_prioritize_scores_each_node(served):
    small = pod("small", ("main", {MEMORY: 2, CORE: 10}))
    scores = served.post("prioritize", {"Pod": small, "NodeNames": ["a", "b"]})
    assert [p["Host"] for p in scores] == ["a", "b"]
    by_host = {p["Host"]: p["Score"] for p in scores}
    assert by_host["a"] > by_host["b"]  # binpack: the fuller node


def bind_args(name, uid, node_name):
    return {"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node_name}


def test_bind_annotates_binds_and_counts_at_once(served):
    """After a filter that passed b: the gpushare annotations, the placement signed with
    the extender's key (the one the nodes believe), then the Binding."""
    served.post("filter", {"Pod": served_pod_job(), "NodeNames": ["a", "b"]})
    result = served.post("bind", bind_args("job", "u-job", "b"))
    assert result == {"Error": ""}
    assert served.binder.calls == [
        (
            "annotate",
            "default",
            "job",
            {
                "ALIYUN_COM_GPU_MEM_IDX": "0",
                "ALIYUN_COM_GPU_MEM_POD": "6",
                "ALIYUN_COM_GPU_MEM_DEV": "15",
                "ALIYUN_COM_GPU_MEM_ASSIGNED": "false",
                "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "42",
                "scheduler.framework.gpushare.allocation": '{"0":{"0":6}}',
                **placed("u-job", "b", {0: 0}, t=42),
            },
        ),
        ("bind", "default", "job", "u-job", "b"),
    ]
    cache = served.extender.cache
    with cache.lock:
        assert cache.view("b").loads[0].memory_units_free == 9
    unknown = served.post(
        "bind", {"PodName": "ghost", "PodNamespace": "default", "PodUID": "u-x", "Node": "b"}
    )
    assert unknown["Error"] == (
        "gpushare-scheduler does not know pod default/ghost with UID u-x: neither its pod "
        "watch nor a filter call has shown it"
    )


def test_a_failed_bind_frees_the_cards_and_one_without_answer_keeps_them(served):
    cache = served.extender.cache
    served.post("filter", {"Pod": served_pod_job(), "NodeNames": ["b"]})
    args = {"PodName": "job", "PodNamespace": "default", "PodUID": "u-job", "Node": "b"}
    served.binder.fail_bind = KubeConflict("create pods/default/job/binding: HTTP 409", 409)
    assert "could not bind default/job to b: create" in served.post("bind", args)["Error"]
    assert not cache.is_assumed("u-job")
    served.binder.fail_bind = KubeUnavailable("create ...: no answer from the API server")
    assert served.post("bind", args)["Error"]
    assert cache.is_assumed("u-job")  # it may have happened: counted until it expires


def test_concurrent_binds_never_share_a_card():
    pods = [pod(f"p{i}", ("main", {MEMORY: 8, CORE: 10}), uid=f"u{i}") for i in range(12)]
    s = Served(cache_with([node("b", annotation((0, 0), (0, 0)))], pods))
    try:
        results = {}
        for p in pods:
            s.post("filter", {"Pod": p, "NodeNames": ["b"]})

        def bind(i):
            results[i] = s.post(
                "bind",
                {"PodName": f"p{i}", "PodNamespace": "default", "PodUID": f"u{i}", "Node": "b"},
            )["Error"]

        threads = [threading.Thread(target=bind, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bound = [i for i, error in results.items() if not error]
        assert len(bound) == 2  # one 8 GiB container per 15 GiB card
        cards = [
            json.loads(c[3]["scheduler.framework.gpushare.allocation"])["0"]
            for c in s.binder.calls
            if c[0] == "annotate"
        ]
        assert sorted(next(iter(c)) for c in cards) == ["0", "1"]
        refusals = [e for e in results.values() if e]
        assert all(
            "no longer fits b: no single GPU on b has 8 GiB and 10 percent free" in e
            for e in refusals
        )
        assert all(sprintf_no_args(e) == e for e in refusals)  # as the event shows it
    finally:
        s.close()


def test_nothing_is_decided_before_the_cache_is_listed():
    cache = ClusterCache(RESOURCES, "gpushare.aliyun.com/", "binpack")
    s = Served(cache)
    try:
        assert s.request("GET", "/healthz") == (503, "not ready: nodes and pods not listed yet\n")
        assert s.health("GET", "/healthz") == (503, "not ready: nodes and pods not listed yet\n")
        job = pod("job", ("main", {MEMORY: 1}))
        result = s.post("filter", {"Pod": job, "NodeNames": ["a"]})
        assert result["Error"].startswith("gpushare-scheduler has not listed the cluster's nodes")
        bound = s.post("bind", {"PodName": "job", "PodNamespace": "default", "Node": "a"})
        assert bound["Error"].startswith("gpushare-scheduler has not listed")
        cache.node_handler.replace(iter(NODES))
        assert s.request("GET", "/healthz")[0] == 503
        cache.pod_handler.replace(iter([job]))
        assert s.request("GET", "/gpushare-scheduler/healthz") == (200, "ok\n")
        assert s.health("GET", "/healthz") == (200, "ok\n")
    finally:
        s.close()


def families(text: str) -> dict[str, object]:
    """The metric families of a Prometheus text exposition, by name (the library's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition: (name, its labels) -> value."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in families(text).values()
        for sample in family.samples  # type: ignore[attr-defined]
    }


# Every family the extender exports: (type, label names). Names and labels are public.
EXTENDER_FAMILIES = {
    "gpushare_extender_requests": ("counter", {"verb", "result"}),
    "gpushare_extender_request_duration_seconds": ("histogram", {"verb"}),
    "gpushare_extender_nodes": ("gauge", set()),
    "gpushare_extender_gpu_nodes": ("gauge", set()),
    "gpushare_extender_pods": ("gauge", set()),
    "gpushare_extender_assumed_pods": ("gauge", set()),
    "gpushare_extender_cache_synced": ("gauge", {"resource"}),
    "gpushare_extender_watch_connected": ("gauge", {"resource"}),
    "gpushare_extender_assumptions_expired": ("counter", set()),
    "gpushare_extender_assumptions_confirmed": ("counter", set()),
    "gpushare_extender_connections_closed": ("counter", {"listener", "reason"}),
}


class Watch:
    def __init__(self, synced: bool, watching: bool):
        self.synced, self.watching = synced, watching


def test_metrics_keep_every_family_name_type_and_label():
    """/metrics exports every family the extender has always exported, with its type and
    label names (besides the ``_created`` series of its counters and histogram), each
    with a sample once there is something to count."""
    cache = cache_with(NODES, [])
    watches = {"nodes": Watch(True, True), "pods": Watch(True, False)}
    s = Served(cache, watches=watches)
    try:
        s.post("filter", {"Pod": pod("x", ("main", {WHOLE: 1})), "NodeNames": ["a", "b"]})
        # One connection closed for a reason, as the listeners count them.
        s.server.serving.call(lambda: s.server.stats.count("https", "evicted"))
        status, text = s.request("GET", "/metrics")
        assert status == 200
    finally:
        s.close()
    exported = families(text)
    created = {name for name in exported if name.endswith("_created")}
    assert set(exported) - created == set(EXTENDER_FAMILIES)
    for name, (kind, labels) in EXTENDER_FAMILIES.items():
        family = exported[name]
        assert family.type == kind, name  # type: ignore[attr-defined]
        assert family.samples, name  # type: ignore[attr-defined]
        for sample in family.samples:  # type: ignore[attr-defined]
            assert set(sample.labels) - {"le"} == labels, (name, sample)
    values = samples(text)
    assert values[("gpushare_extender_cache_synced", frozenset({("resource", "pods")}))] == 1
    assert values[("gpushare_extender_watch_connected", frozenset({("resource", "pods")}))] == 0
    closed = frozenset({("listener", "https"), ("reason", "evicted")})
    assert values[("gpushare_extender_connections_closed_total", closed)] == 1


def test_metrics_and_http_errors(served):
    """Each answered call is counted by verb and result and timed; bad bodies get 400
    naming the field, unknown paths 404, wrong methods 405; /metrics is served on both
    ports."""
    served.post("filter", {"Pod": pod("x", ("main", {WHOLE: 1})), "NodeNames": ["a", "b"]})
    status, body = served.request("POST", "/gpushare-scheduler/filter", b"{broken")
    assert status == 400 and "ExtenderArgs: the body is not JSON" in body
    status, body = served.request("POST", "/bind", {"PodNamespace": "default", "Node": "b"})
    assert (status, json.loads(body)) == (400, {"error": "ExtenderBindingArgs.PodName: required"})
    assert served.request("GET", "/filter")[0] == 405
    assert served.request("POST", "/preempt", {})[0] == 404
    status, text = served.request("GET", "/metrics")
    assert status == 200
    values = samples(text)
    ok = frozenset({("verb", "filter"), ("result", "ok")})
    bad = frozenset({("verb", "filter"), ("result", "bad_request")})
    assert values[("gpushare_extender_requests_total", ok)] == 1
    assert values[("gpushare_extender_requests_total", bad)] == 1
    filter_verb = frozenset({("verb", "filter")})
    assert values[("gpushare_extender_request_duration_seconds_count", filter_verb)] == 2
    assert values[("gpushare_extender_nodes", frozenset())] == 2
    assert values[("gpushare_extender_gpu_nodes", frozenset())] == 2
    assert values[("gpushare_extender_assumed_pods", frozenset())] == 0
    assert served.health("GET", "/metrics")[0] == 200


def test_the_plain_port_serves_the_probes_only(served):
    """kubelet's probes present no client certificate: the plain port answers GET /healthz
    and /metrics, and nothing else (no verb, no body)."""
    job = json.dumps({"Pod": served_pod_job(), "NodeNames": ["b"]}).encode()
    for path in ("/gpushare-scheduler/filter", "/filter", "/bind"):
        assert served.health("POST", path, job)[0] == 413  # no body is read there
        status, text = served.health("POST", path, b"")
        assert status == 404 and "the verbs are on the HTTPS port" in text
    assert served.health("GET", "/gpushare-scheduler/filter")[0] == 405
    assert served.health("GET", "/nothing")[0] == 404
    assert served.binder.calls == []


def test_reasons_read_right_after_go_fmt_and_in_the_condition(served):
    """kube-scheduler posts the extender's reasons as the *format* of the FailedScheduling
    event (Go's Eventf with no arguments) and puts them unformatted in the pod's
    PodScheduled condition: both must read right, so no reason carries a ``%``."""
    job = pod("big", ("main", {MEMORY: 6, CORE: 95}), uid="u-big")
    result = served.post("filter", {"Pod": job, "NodeNames": ["a", "b", "nowhere"]})
    reasons = {**result["FailedNodes"], **result["FailedAndUnresolvableNodes"]}
    assert set(reasons) == {"a", "nowhere"}  # b has a card with 95 % free
    for reason in reasons.values():
        assert sprintf_no_args(reason) == reason, reason
    assert reasons["a"] == (
        "no single GPU on a has 6 GiB and 95 percent free: GPU0 (Tesla T4) has 8 GiB/20 "
        "percent free, GPU1 (Tesla T4) has 4 GiB/90 percent free"
    )


def served_pod_job():
    return pod("job", ("main", {MEMORY: 6, CORE: 40}), uid="u-job")


def test_bind_only_by_the_pods_uid_to_a_node_that_passed_its_filter(served):
    """kube-scheduler ran its own filters (taints, selectors, affinity) before it sent the
    nodes to this extender's filter: a bind that names no UID, another UID, a pod no
    filter has shown, a node that did not pass, or a pod already bound, is refused and
    writes nothing."""
    job = served_pod_job()
    refused = {
        "no UID": bind_args("job", "", "b"),
        "another UID": bind_args("job", "u-other", "b"),
        "never filtered": bind_args("job", "u-job", "b"),
    }
    answers = {why: served.post("bind", args)["Error"] for why, args in refused.items()}
    assert answers["no UID"] == (
        "gpushare-scheduler binds a pod by its UID only: the bind of default/job names none"
    )
    assert answers["another UID"].startswith("gpushare-scheduler does not know pod default/job")
    assert answers["never filtered"] == (
        "b did not pass gpushare-scheduler's filter for default/job (UID u-job): "
        "kube-scheduler filters the pod again"
    )
    served.post("filter", {"Pod": job, "NodeNames": ["a", "b", "quarantine"]})
    assert served.post("bind", bind_args("job", "u-job", "quarantine"))["Error"].startswith(
        "quarantine did not pass gpushare-scheduler's filter for default/job"
    )
    assert served.post("bind", bind_args("job", "u-job", "a"))["Error"].startswith("a did not pass")
    assert served.binder.calls == []
    cache = served.extender.cache
    bound = dict(job, spec={**job["spec"], "nodeName": "b"})
    cache.pod_handler.apply("MODIFIED", bound)
    assert served.post("bind", bind_args("job", "u-job", "b"))["Error"] == (
        "default/job is already bound to b"
    )
    assert served.binder.calls == []
