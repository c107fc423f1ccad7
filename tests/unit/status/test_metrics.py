"""Pins the Prometheus endpoint (nodemgr.status.metrics) as a scraper sees it: the real
HTTP server on 127.0.0.1:0, scraped with urllib and parsed with prometheus_client's
own parser.

What it pins: card and allocation gauges in base units (bytes, ratios) with
their labels; unknown (None) values left out, never exported as 0; MPS up per
state (absent where MPS is not meant to run); the enforcement and reconcile
counters; the Allocate histogram; a failing or malformed snapshot leaving the
rest of the scrape intact and counted; a clear bind error; stop() freeing the
port; the gRPC servicer reporting each Allocate's latency and result; and the
Grafana dashboard referring only to metric and label names the exporter really
exposes (so the dashboard cannot drift from the code).
Worker health: gpushare_worker_up and restarts per worker, gpushare_daemon_healthy, and
the watchdog's unreadable processes; enforcement that cannot judge; each listener's
connections, cap and refusals.

Why this module is longer than 400 lines: it pins every metric family and label the
Grafana dashboard and operators depend on (a public interface).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.reconcile import ReconcilePlan
from nodemgr.errors import BindError
from nodemgr.inventory import open_inventory
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2 as dp
from nodemgr.kubelet.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from nodemgr.kubelet.servicer import PluginServer
from nodemgr.status.metrics import Metrics
from standins.cards import GPU0, GPU1
from standins.threadstats import wakeups_while_idle

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "gpushare-node.json"
MIB = 1024 * 1024
MEM_RESOURCE = "aliyun.com/gpu-mem"


def document() -> dict:
    """A status document as nodemgr.domain.statusdoc builds it: two cards, two allocations."""
    return {
        "schema": 1,
        "node": "node-a",
        "source": "daemon",
        "daemon": {"pid": 4242, "started_at": 1000.0, "ready": True, "version": "0.1.0"},
        "gpus": [
            {
                "index": 0,
                "uuid": GPU0,
                "model": "Tesla T4",
                "mode": "shared",
                "memory_total_mib": 15360,
                "memory_allocated_mib": 6144,
                "memory_used_mib": 2500,
                "core_allocated_percent": 40,
                "healthy": True,
                "problem": None,
                "mps": {"state": "healthy", "clients": 2, "detail": ""},
                "allocations": 2,
            },
            {
                "index": 1,
                "uuid": GPU1,
                "model": "Tesla T4",
                "mode": "idle",
                "memory_total_mib": 15360,
                "memory_allocated_mib": 0,
                "memory_used_mib": 0,
                "core_allocated_percent": 0,
                "healthy": False,
                "problem": "MPS control daemon is down",
                "mps": {"state": "down", "clients": None, "detail": "no answer"},
                "allocations": 0,
            },
        ],
        "allocations": [
            {
                "id": "alloc-1",
                "gpu": GPU0,
                "gpu_index": 0,
                "gpus": [GPU0],
                "whole": False,
                "memory_mib": 4096,
                "memory_used_mib": 2000,
                "core_percent": 30,
                "namespace": "default",
                "pod": "train",
                "container": "main",
                "state": "confirmed",
                "containers": 1,
                "violations": 3,
                "created_at": 1500.5,
                "isolation": {
                    "memory": "enforced",
                    "memory_detail": "the watchdog adds up the container's GPU processes",
                    "compute": "advisory",
                    "compute_detail": "MPS applies 30% of the SMs from the client's env",
                },
            },
            {
                "id": "alloc-2",
                "gpu": GPU0,
                "gpu_index": 0,
                "gpus": [GPU0],
                "whole": False,
                "memory_mib": 2048,
                "memory_used_mib": None,
                "core_percent": 10,
                "namespace": None,
                "pod": None,
                "container": None,
                "state": "pending",
                "containers": 0,
                "violations": 0,
                "created_at": 1600.0,
                "isolation": {
                    "memory": "advisory",
                    "memory_detail": "per-process GPU memory cannot be read",
                    "compute": "advisory",
                    "compute_detail": "MPS applies 10% of the SMs from the client's env",
                },
            },
        ],
        "enforcement": {
            "action": "kill",
            "violations": {"memory": 4, "env": 1, "unallocated": 0},
            "kills": 5,
        },
    }


class Exporter:
    """A Metrics over a snapshot the test can change or break, served on 127.0.0.1:0."""

    def __init__(self):
        self.doc = document()
        self.error: Exception | None = None
        self.metrics = Metrics(self._snapshot)
        self.server = self.metrics.serve("127.0.0.1:0")

    def _snapshot(self):
        if self.error is not None:
            raise self.error
        return copy.deepcopy(self.doc)

    def scrape(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Sample name -> [(labels, value)], as a scraper parses the endpoint."""
        return parse(scrape_text(self.server.port))


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples, name, **labels) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [v for got, v in samples.get(name, []) if labels.items() <= got.items()]
    assert len(found) == 1, f"{name}{labels}: {found} in {samples.get(name)}"
    return found[0]


def absent(samples, name, **labels) -> bool:
    return not [v for got, v in samples.get(name, []) if labels.items() <= got.items()]


@pytest.fixture
def exporter():
    exporter = Exporter()
    yield exporter
    exporter.server.stop()


def test_card_gauges_are_in_bytes_and_ratios_with_card_labels(exporter):
    s = exporter.scrape()
    card0 = {"gpu": GPU0, "index": "0", "model": "Tesla T4"}
    assert value(s, "gpushare_gpu_memory_total_bytes", **card0) == 15360 * MIB
    assert value(s, "gpushare_gpu_memory_allocated_bytes", **card0) == 6144 * MIB
    assert value(s, "gpushare_gpu_memory_used_bytes", **card0) == 2500 * MIB
    assert value(s, "gpushare_gpu_core_allocated_ratio", **card0) == pytest.approx(0.4)
    assert value(s, "gpushare_gpu_allocations", **card0) == 2
    assert value(s, "gpushare_gpu_healthy", **card0) == 1
    assert value(s, "gpushare_gpu_healthy", gpu=GPU1) == 0
    assert value(s, "gpushare_gpu_mps_clients", **card0) == 2
    assert value(s, "gpushare_gpu_mode", gpu=GPU0, mode="shared") == 1
    assert value(s, "gpushare_gpu_mode", gpu=GPU0, mode="idle") == 0
    assert value(s, "gpushare_gpu_mode", gpu=GPU1, mode="idle") == 1
    assert value(s, "gpushare_daemon_ready") == 1
    assert value(s, "gpushare_build_info", version="0.1.0", node="node-a") == 1


def test_allocation_gauges_carry_owner_labels(exporter):
    """Each allocation gauge is labelled by owner, card and mode; a pending allocation
    (owner not known yet) has empty owner labels."""
    s = exporter.scrape()
    owned = {
        "namespace": "default",
        "pod": "train",
        "container": "main",
        "gpu": GPU0,
        "mode": "shared",
    }
    assert value(s, "gpushare_allocation_memory_quota_bytes", **owned) == 4096 * MIB
    assert value(s, "gpushare_allocation_memory_used_bytes", **owned) == 2000 * MIB
    assert value(s, "gpushare_allocation_core_quota_ratio", **owned) == pytest.approx(0.3)
    assert value(s, "gpushare_allocation_confirmed", **owned) == 1
    assert value(s, "gpushare_allocation_containers", **owned) == 1
    assert value(s, "gpushare_allocation_violations", **owned) == 3
    assert value(s, "gpushare_allocation_start_time_seconds", **owned) == 1500.5
    # Owner not known yet: empty labels (absent to PromQL), and still pending.
    pending = {"namespace": "", "pod": "", "container": ""}
    assert value(s, "gpushare_allocation_memory_quota_bytes", **pending) == 2048 * MIB
    assert value(s, "gpushare_allocation_confirmed", **pending) == 0


def test_a_whole_card_allocation_is_labelled_whole(exporter):
    exporter.doc["allocations"][0].update(whole=True, memory_mib=15360, core_percent=100)
    s = exporter.scrape()
    assert value(s, "gpushare_allocation_core_quota_ratio", pod="train", mode="whole") == 1
    assert absent(s, "gpushare_allocation_core_quota_ratio", pod="train", mode="shared")


def test_unknown_values_are_left_out_never_exported_as_zero(exporter):
    doc = exporter.doc
    doc["gpus"][0].update(memory_used_mib=None, healthy=None)
    doc["gpus"][0]["mps"]["clients"] = None
    doc["daemon"] = None
    doc["enforcement"] = None
    s = exporter.scrape()
    assert absent(s, "gpushare_gpu_memory_used_bytes", gpu=GPU0)
    assert value(s, "gpushare_gpu_memory_used_bytes", gpu=GPU1) == 0  # a known 0 stays
    assert absent(s, "gpushare_gpu_healthy", gpu=GPU0)
    assert absent(s, "gpushare_gpu_mps_clients", gpu=GPU0)
    assert absent(s, "gpushare_allocation_memory_used_bytes", pod="")
    for name in (
        "gpushare_daemon_ready",
        "gpushare_build_info",
        "gpushare_enforcement_kills_total",
        "gpushare_enforcement_violations_total",
        "gpushare_enforcement_action",
    ):
        assert absent(s, name), name
    # The rest of the card is still there.
    assert value(s, "gpushare_gpu_memory_total_bytes", gpu=GPU0) == 15360 * MIB


@pytest.mark.parametrize(
    ("state", "up"),
    [
        ("healthy", 1),
        ("starting", 0),
        ("down", 0),
        ("hung", 0),
        ("broken", 0),
        ("fault", 0),
        ("something-new", 0),  # a state this code does not know must not read as fine
        ("off", None),  # card given out whole: MPS left on purpose
        ("disabled", None),  # mps.enabled false
        ("unknown", None),
    ],
)
def test_mps_up_is_absent_where_mps_is_not_meant_to_run(exporter, state, up):
    exporter.doc["gpus"][0]["mps"]["state"] = state
    s = exporter.scrape()
    if up is None:
        assert absent(s, "gpushare_gpu_mps_up", gpu=GPU0)
    else:
        assert value(s, "gpushare_gpu_mps_up", gpu=GPU0) == up
    states = {got["state"]: v for got, v in s["gpushare_gpu_mps_state"] if got["gpu"] == GPU0}
    assert states[state] == 1
    assert sum(states.values()) == 1
    assert {"healthy", "down", "off", "disabled"} <= states.keys()  # every state, for alerts


def test_enforcement_counters(exporter):
    """Violation onsets by kind (every kind present, mps_control too, 0 when none), kills,
    the action in force."""
    s = exporter.scrape()
    assert value(s, "gpushare_enforcement_violations_total", kind="memory") == 4
    assert value(s, "gpushare_enforcement_violations_total", kind="env") == 1
    assert value(s, "gpushare_enforcement_violations_total", kind="unallocated") == 0
    assert value(s, "gpushare_enforcement_violations_total", kind="mps_control") == 0
    assert value(s, "gpushare_enforcement_kills_total") == 5
    assert value(s, "gpushare_enforcement_action", action="kill") == 1
    assert value(s, "gpushare_enforcement_action", action="log") == 0


def test_allocate_histogram(exporter):
    m = exporter.metrics
    m.observe_allocate(MEM_RESOURCE, 0.0003, True)
    m.observe_allocate(MEM_RESOURCE, 0.001, True)  # on a bound: counted in it (le is <=)
    m.observe_allocate(MEM_RESOURCE, 0.02, True)
    m.observe_allocate(MEM_RESOURCE, 3.0, False)  # past the last bound: +Inf only
    s = exporter.scrape()
    ok = {"resource": MEM_RESOURCE, "result": "ok"}
    bucket = "gpushare_allocate_duration_seconds_bucket"
    assert value(s, bucket, le="0.0005", **ok) == 1
    assert value(s, bucket, le="0.001", **ok) == 2
    assert value(s, bucket, le="0.01", **ok) == 2
    assert value(s, bucket, le="0.025", **ok) == 3
    assert value(s, bucket, le="+Inf", **ok) == 3
    assert value(s, "gpushare_allocate_duration_seconds_count", **ok) == 3
    assert value(s, "gpushare_allocate_duration_seconds_sum", **ok) == pytest.approx(0.0213)
    error = {"resource": MEM_RESOURCE, "result": "error"}
    assert value(s, bucket, le="2.5", **error) == 0
    assert value(s, bucket, le="+Inf", **error) == 1
    # Buckets are cumulative: never decreasing with le.
    counts = [v for got, v in s[bucket] if got["result"] == "ok"]
    assert counts == sorted(counts)


def test_reconcile_counters(exporter):
    m = exporter.metrics
    s = exporter.scrape()
    for result in ("ok", "skipped", "failed"):  # present from the start, at a true 0
        assert value(s, "gpushare_reconcile_total", result=result) == 0
    m.count_reconcile("ok")
    m.count_reconcile("ok")
    m.count_reconcile("skipped")
    m.count_reconcile_plan(ReconcilePlan(put=["a", "b", "c"], delete=["d"], notes=["why"]))
    m.count_reconcile_plan(ReconcilePlan(delete=["e"]))
    s = exporter.scrape()
    assert value(s, "gpushare_reconcile_total", result="ok") == 2
    assert value(s, "gpushare_reconcile_total", result="skipped") == 1
    assert value(s, "gpushare_reconcile_total", result="failed") == 0
    assert value(s, "gpushare_reconcile_allocations_released_total") == 2
    assert value(s, "gpushare_reconcile_allocations_updated_total") == 3
    with pytest.raises(ValueError, match="reconcile result"):
        m.count_reconcile("fine")


def test_a_failing_snapshot_leaves_the_rest_of_the_scrape(exporter, caplog):
    exporter.metrics.observe_allocate(MEM_RESOURCE, 0.002, True)
    exporter.metrics.count_reconcile("ok")
    exporter.error = RuntimeError("ledger locked")
    with caplog.at_level(logging.ERROR, logger="nodemgr.status.metrics"):
        s = exporter.scrape()
        assert value(s, "gpushare_scrape_errors_total") == 1
        assert absent(s, "gpushare_gpu_memory_total_bytes")
        assert absent(s, "gpushare_daemon_ready")
        assert value(s, "gpushare_allocate_duration_seconds_count", result="ok") == 1
        assert value(s, "gpushare_reconcile_total", result="ok") == 1
        s = exporter.scrape()
        assert value(s, "gpushare_scrape_errors_total") == 2
    # Logged once per distinct failure, not once per scrape.
    assert [r.message for r in caplog.records].count(
        "metrics: the status snapshot failed; exporting the rest"
    ) == 1
    exporter.error = None
    s = exporter.scrape()
    assert value(s, "gpushare_gpu_memory_total_bytes", gpu=GPU0) == 15360 * MIB
    assert value(s, "gpushare_scrape_errors_total") == 2


def test_a_malformed_document_gives_no_half_truths(exporter):
    del exporter.doc["gpus"][1]["mps"]  # the second card breaks after the first was read
    s = exporter.scrape()
    assert value(s, "gpushare_scrape_errors_total") == 1
    assert absent(s, "gpushare_gpu_memory_total_bytes")
    assert absent(s, "gpushare_daemon_ready")


def test_bind_failure_says_which_address_and_why():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(BindError) as in_use:
            Metrics(document).serve(f"127.0.0.1:{port}")
    finally:
        holder.close()
    message = str(in_use.value)
    assert f"127.0.0.1:{port}" in message
    assert "in use (another gpushare-node or exporter?)" in message
    assert "metrics.address" in message
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is no address of this machine.
    with pytest.raises(BindError, match=r"192\.0\.2\.1:0: no interface of this node"):
        Metrics(document).serve("192.0.2.1:0")


def test_stop_closes_the_socket_promptly_and_frees_the_port():
    metrics = Metrics(document)
    server = metrics.serve("127.0.0.1:0")
    port = server.port
    assert port != 0
    assert "gpushare_gpu_memory_total_bytes" in parse(scrape_text(port))
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 1.0
    with pytest.raises(urllib.error.URLError):
        scrape_text(port)
    # The same port can be served again at once (what a restart of the daemon does).
    again = metrics.serve(f"127.0.0.1:{port}")
    try:
        assert again.port == port
        assert "gpushare_daemon_ready" in parse(scrape_text(port))
    finally:
        again.stop()
    server.stop()  # a second stop is harmless


def test_an_idle_metrics_server_never_wakes_up():
    """Between scrapes the serving thread sleeps in select with no timeout (the old poll
    interval woke it 20 times a second, on every node, for nothing)."""
    server = Metrics(document).serve("127.0.0.1:0")
    try:
        scrape_text(server.port)
        assert wakeups_while_idle(server._thread) == 0
    finally:
        server.stop()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_serves_on_an_ipv6_address():
    server = Metrics(document).serve("[::1]:0")
    try:
        url = f"http://[::1]:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert "gpushare_gpu_memory_total_bytes" in parse(response.read().decode())
    finally:
        server.stop()


# --- the gRPC servicer feeds the histogram -----------------------------------------------


def test_plugin_server_reports_each_allocate_with_its_result(settings, tmp_path):
    seen: list[tuple[str, float, bool]] = []
    cards = open_inventory(settings.gpus).cards()
    ledger = Ledger(settings.state_dir)
    allocator = Allocator(settings, cards, ledger)
    socket_path = os.path.join(tmp_path, "mem.sock")
    server = PluginServer(
        allocator, ResourceKind.MEMORY, socket_path, lambda *call: seen.append(call)
    )
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            stub = dp_grpc.DevicePluginStub(channel)

            def allocate(ids):
                request = dp.AllocateRequest(
                    container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)]
                )
                return stub.Allocate(request, timeout=10)

            answer = allocate([f"{GPU0}-_-0", f"{GPU0}-_-1"])
            assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == GPU0
            with pytest.raises(grpc.RpcError) as refused:
                allocate(["GPU-gone-_-0"])
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop()
        ledger.close()
    assert [(resource, ok) for resource, _, ok in seen] == [
        (MEM_RESOURCE, True),
        (MEM_RESOURCE, False),
    ]
    assert all(0 < seconds < 10 for _, seconds, _ in seen)


def test_a_failing_observer_does_not_fail_allocate(settings, tmp_path, caplog):
    def broken(resource, seconds, ok):
        raise RuntimeError("metrics bug")

    cards = open_inventory(settings.gpus).cards()
    ledger = Ledger(settings.state_dir)
    socket_path = os.path.join(tmp_path, "mem.sock")
    server = PluginServer(
        Allocator(settings, cards, ledger), ResourceKind.MEMORY, socket_path, broken
    )
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            request = dp.AllocateRequest(
                container_requests=[dp.ContainerAllocateRequest(devices_ids=[f"{GPU1}-_-0"])]
            )
            answer = dp_grpc.DevicePluginStub(channel).Allocate(request, timeout=10)
        assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == GPU1
        assert "aliyun.com/gpu-mem: observing Allocate failed" in caplog.text
    finally:
        server.stop()
        ledger.close()


# --- the Grafana dashboard ----------------------------------------------------------------

# PromQL words the dashboard may use besides metric and label names.
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "without", "on", "ignoring", "group_left",
    "group_right", "and", "or", "unless", "rate", "increase", "irate", "histogram_quantile",
    "clamp_min", "max_over_time", "time", "le", "bool",
    "label_values",  # Grafana's variable query function
}  # fmt: skip
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every series it scrapes


def exposed() -> tuple[set[str], set[str]]:
    """Every sample name and label name a fully populated exporter serves."""
    metrics = Metrics(document)
    metrics.observe_allocate(MEM_RESOURCE, 0.001, True)
    samples = parse(metrics.render().decode())
    labels = {name for series in samples.values() for got, _ in series for name in got}
    return set(samples), labels


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            found.append((variable["name"], query["query"] if isinstance(query, dict) else query))
    return found


def test_dashboard_is_a_grafana_model_on_a_prometheus_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"node", "instance"} <= variables.keys()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys(), panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert 'instance=~"$instance"' in target["expr"], panel["title"]


def problems(exprs: list[tuple[str, str]], names: set[str], labels: set[str]) -> list[str]:
    """Metric or label names in the expressions that the exporter does not serve."""
    found = []
    for where, expr in exprs:
        # Label matchers name labels; strings, ranges and Grafana variables are not names.
        for matcher in re.findall(r"\{([^}]*)\}", expr):
            for label in re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matcher):
                if label not in labels | TARGET_LABELS:
                    found.append(f"{where}: label {label} is not exposed")
        bare = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]|\$\w+', " ", expr)
        for word in re.findall(r"[a-zA-Z_:][\w:]*", bare):
            if word.startswith("gpushare_"):
                if word not in names:
                    found.append(f"{where}: metric {word} is not exposed by nodemgr.status.metrics")
            elif word not in PROMQL_WORDS | labels | TARGET_LABELS:
                found.append(f"{where}: {word} is neither PromQL nor an exposed label")
    return found


def table_columns(dashboard: dict) -> list[tuple[str, str]]:
    """(panel, label) for each column a table panel's organize step names by label."""
    found = []
    for panel in dashboard["panels"]:
        for step in panel.get("transformations", []):
            if step["id"] == "organize":
                for column in step["options"].get("indexByName", {}):
                    if not column.startswith("Value #") and column != "Time":
                        found.append((panel["title"], column))
    return found


def test_dashboard_uses_only_metrics_and_labels_the_exporter_serves():
    """Every metric and label of the dashboard's queries, and every label its tables
    order as a column, is one the exporter serves (the ``allocation`` label is gone)."""
    names, labels = exposed()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dashboard)
    assert problems(exprs, names, labels) == []
    columns = table_columns(dashboard)
    assert ("Allocations: quota vs use", "memory") in columns
    assert [c for c in columns if c[1] not in labels | TARGET_LABELS] == []
    used = {word for _, expr in exprs for word in re.findall(r"gpushare_\w+", expr)}
    for wanted in (  # the panels the issue asks for
        "gpushare_gpu_memory_allocated_bytes",
        "gpushare_gpu_memory_used_bytes",
        "gpushare_gpu_memory_total_bytes",
        "gpushare_gpu_core_allocated_ratio",
        "gpushare_gpu_mps_up",
        "gpushare_allocation_memory_quota_bytes",
        "gpushare_allocation_memory_used_bytes",
        "gpushare_enforcement_kills_total",
        "gpushare_enforcement_violations_total",
        "gpushare_allocate_duration_seconds_bucket",
        "gpushare_reconcile_total",
    ):
        assert wanted in used, wanted


def test_the_drift_check_catches_renamed_metrics_and_labels():
    names, labels = exposed()
    drifted = [
        ("memory", 'gpushare_gpu_memory_used_mib{instance=~"$instance"}'),
        ("quota", "sum by (namespace, card) (gpushare_allocation_memory_quota_bytes)"),
        ("mps", 'gpushare_gpu_mps_up{uuid="x"}'),
    ]
    assert problems(drifted, names, labels) == [
        "memory: metric gpushare_gpu_memory_used_mib is not exposed by nodemgr.status.metrics",
        "quota: card is neither PromQL nor an exposed label",
        "mps: label uuid is not exposed",
    ]


# --- worker health (issue 14, item 3) -----------------------------------------------------------


def test_each_worker_is_up_or_down_with_its_restarts(exporter):
    """gpushare_worker_up{worker} is 0 for a worker that is down (an alert on it names the
    part of the daemon that stopped), with its restarts; gpushare_daemon_healthy says the
    same for the whole daemon; unreadable processes the watchdog met are counted."""
    exporter.doc["daemon"]["healthy"] = False
    exporter.doc["daemon"]["workers"] = {
        "watchdog": {"up": False, "restarts": 5, "failure": "UnicodeDecodeError: ..."},
        "mps-supervisor": {"up": True, "restarts": 0, "failure": None},
    }
    exporter.doc["enforcement"]["unreadable_processes"] = 3
    s = exporter.scrape()
    assert value(s, "gpushare_worker_up", worker="watchdog") == 0
    assert value(s, "gpushare_worker_up", worker="mps-supervisor") == 1
    assert value(s, "gpushare_worker_restarts_total", worker="watchdog") == 5
    assert value(s, "gpushare_worker_restarts_total", worker="mps-supervisor") == 0
    assert value(s, "gpushare_daemon_healthy") == 0
    assert value(s, "gpushare_enforcement_unreadable_processes_total") == 3


def test_enforcement_that_cannot_judge_is_exported(exporter):
    """gpushare_enforcement_judging is 0 while the watchdog cannot judge (1 otherwise), the
    failed scans are counted, and gpushare_daemon_healthy is 0 (the document says so)."""
    exporter.doc["daemon"]["healthy"] = False
    exporter.doc["enforcement"].update(
        judging=False, problem="enforcement cannot judge: ...", failed_scans=7
    )
    s = exporter.scrape()
    assert value(s, "gpushare_enforcement_judging") == 0
    assert value(s, "gpushare_enforcement_failed_scans_total") == 7
    assert value(s, "gpushare_daemon_healthy") == 0
    exporter.doc["enforcement"]["judging"] = True
    assert value(exporter.scrape(), "gpushare_enforcement_judging") == 1


def test_each_listener_shows_its_connections_cap_and_refusals(exporter):
    """gpushare_listener_connections (absent when unknown: gRPC), _max_connections, and
    gpushare_listener_refused_total by listener and reason."""
    exporter.doc["daemon"]["listeners"] = {
        "metrics": {
            "connections": 16,
            "max_connections": 16,
            "deadline_seconds": 10.0,
            "refused": {"cap": 1184, "deadline": 0, "slow": 16},
        },
        "device-plugin:aliyun.com/gpu-mem": {
            "connections": None,
            "max_connections": 8,
            "deadline_seconds": None,
            "refused": {},
        },
    }
    s = exporter.scrape()
    assert value(s, "gpushare_listener_connections", listener="metrics") == 16
    assert absent(s, "gpushare_listener_connections", listener="device-plugin:aliyun.com/gpu-mem")
    plugin = "device-plugin:aliyun.com/gpu-mem"
    assert value(s, "gpushare_listener_max_connections", listener=plugin) == 8
    assert value(s, "gpushare_listener_refused_total", listener="metrics", reason="cap") == 1184
    assert value(s, "gpushare_listener_refused_total", listener="metrics", reason="slow") == 16


def test_a_document_without_worker_health_still_scrapes(exporter):
    """Older or partial documents (no workers, no healthy) leave those series out."""
    s = exporter.scrape()
    assert absent(s, "gpushare_worker_up") and absent(s, "gpushare_daemon_healthy")
    assert value(s, "gpushare_daemon_ready") == 1


# --- allocations named by owner, never by id; isolation (issue 14) ------------------------------


def test_no_allocation_id_appears_anywhere_in_the_scrape(exporter):
    """Item 5: the endpoint is readable by every local user and hostNetwork pod, and an
    allocation id is the credential the runtime hook accepts: neither id of the document
    appears in the text, and no series has an ``allocation`` label."""
    text = scrape_text(exporter.server.port)
    assert "alloc-1" not in text and "alloc-2" not in text
    samples = parse(text)
    assert not [n for n, series in samples.items() for got, _ in series if "allocation" in got]


def test_allocations_of_unknown_owner_on_one_card_are_added_up(exporter):
    """Two pending allocations on one card cannot be told apart without their ids: they
    are one series, quotas and counts summed, confirmed only if both are, the earliest
    start, use unknown when either is unknown."""
    third = copy.deepcopy(exporter.doc["allocations"][1])
    third.update(id="alloc-3", memory_mib=1024, memory_used_mib=10, core_percent=5,
                 containers=2, violations=1, created_at=1200.0, state="confirmed")  # fmt: skip
    exporter.doc["allocations"].append(third)
    s = exporter.scrape()
    unknown = {"pod": "", "gpu": GPU0, "mode": "shared"}
    assert value(s, "gpushare_allocation_memory_quota_bytes", **unknown) == 3072 * MIB
    assert value(s, "gpushare_allocation_core_quota_ratio", **unknown) == pytest.approx(0.15)
    assert value(s, "gpushare_allocation_containers", **unknown) == 2
    assert value(s, "gpushare_allocation_violations", **unknown) == 1
    assert value(s, "gpushare_allocation_confirmed", **unknown) == 0
    assert value(s, "gpushare_allocation_start_time_seconds", **unknown) == 1200.0
    assert absent(s, "gpushare_allocation_memory_used_bytes", **unknown)
    exporter.doc["allocations"][1]["memory_used_mib"] = 90
    s = exporter.scrape()
    assert value(s, "gpushare_allocation_memory_used_bytes", **unknown) == 100 * MIB


def test_isolation_is_an_info_gauge_per_allocation(exporter):
    """gpushare_allocation_isolation{namespace,pod,container,gpu,mode,memory,compute} is 1
    per allocation with its levels (an alert can select memory!="enforced"); an
    allocation whose isolation is unknown (null) has none; unknown owners with different
    levels on one card give one series per pair of levels."""
    doc = exporter.doc
    doc["allocations"][0]["isolation"] = {
        "memory": "enforced", "memory_detail": "...", "compute": "advisory",
        "compute_detail": "...",
    }  # fmt: skip
    doc["allocations"][1]["isolation"] = None
    s = exporter.scrape()
    assert value(s, "gpushare_allocation_isolation", pod="train", container="main",
                 gpu=GPU0, mode="shared", memory="enforced", compute="advisory") == 1  # fmt: skip
    assert len(s["gpushare_allocation_isolation"]) == 1
    third = copy.deepcopy(doc["allocations"][1])
    third["isolation"] = {"memory": "watched", "compute": "unlimited"}
    doc["allocations"][1]["isolation"] = {"memory": "advisory", "compute": "unlimited"}
    doc["allocations"].append(third)
    s = exporter.scrape()
    pending = {got["memory"] for got, v in s["gpushare_allocation_isolation"] if not got["pod"]}
    assert pending == {"advisory", "watched"}


def test_claims_have_series_of_their_own_and_prepare_its_histogram(exporter):
    """A DRA claim's allocation is exported by namespace and claim name (not summed into
    the device plugin's unknown-owner series); NodePrepareResources has its histogram;
    the plugin's registration is a gauge."""
    claim = copy.deepcopy(exporter.doc["allocations"][1])
    claim |= {"id": "alloc-3", "claim": {"namespace": "ml", "name": "train-gpu", "uid": "u"}}
    exporter.doc["allocations"].append(claim)
    exporter.doc["daemon"]["dra"] = {"driver": "gpushare.aliyun.com", "serving": True,
                                     "registered": True, "registration_error": None}  # fmt: skip
    exporter.metrics.observe_prepare(0.004, True)
    exporter.metrics.observe_prepare(0.2, False)
    s = exporter.scrape()
    labels = {"namespace": "ml", "claim": "train-gpu", "gpu": GPU0, "mode": "shared"}
    assert value(s, "gpushare_claim_memory_quota_bytes", **labels) == 2048 * 1024 * 1024
    assert value(s, "gpushare_claim_core_quota_ratio", **labels) == 0.1
    assert value(s, "gpushare_claim_isolation", memory="advisory", **labels) == 1
    # alloc-2 alone in the unknown-owner series: the claim is not added into it.
    assert value(s, "gpushare_allocation_memory_quota_bytes", pod="") == 2048 * 1024 * 1024
    assert value(s, "gpushare_dra_prepare_duration_seconds_count", result="ok") == 1
    assert value(s, "gpushare_dra_prepare_duration_seconds_count", result="refused") == 1
    assert absent(s, "gpushare_allocate_duration_seconds_count", result="ok")
    assert value(s, "gpushare_dra_registered") == 1 and value(s, "gpushare_dra_serving") == 1
