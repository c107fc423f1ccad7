"""Pins nodemgr.kubernetes.adapter, the facade the daemon uses, against the test API
server (standins/apiserver_sim.py: the real REST and watch protocol, so the kubernetes
client runs end to end): after the server stops and restarts the watch reconnects and the
writes made meanwhile arrive in their latest coalesced form, in one request; 5xx/429 and a
timed-out request are retried; 404 drops a write, 403 drops it with one log line naming
the RBAC; node labels: foreign ones untouched, our stale ones removed; gpu-count in status
capacity and allocatable; events rate-limited, the suppressed ones folded into the next
one's count; the Allocate path's calls return in well under 50 ms while the server hangs
or is down; stop() is prompt (also with a hung server); without credentials, one log line
and nothing else; ``enabled: false``, nothing at all; and API_PERMISSIONS.

The pieces have their own files: client (credentials, errors), podwatch (the cache),
writes (queue, backoff, rate limit), sync (publisher, candidate pods).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from nodemgr.config.schema import KubernetesSettings
from nodemgr.kubernetes.adapter import API_PERMISSIONS, KubeAdapter
from tests.unit.kubernetes.support import (
    NODE,
    PREFIX,
    TIMEOUT_SECONDS,
    FakeClock,
    names,
    requests_of,
    wait_until,
)


def test_permissions_contract():
    """Every request the adapter makes, by group, resource and verb (deploy/'s
    ClusterRole grants exactly these)."""
    assert API_PERMISSIONS == (
        ("", "pods", ("get", "list", "watch", "patch")),
        ("", "nodes", ("get", "patch")),
        ("", "nodes/status", ("patch",)),
        ("", "events", ("create", "patch")),
    )


# --- against the test API server ---------------------------------------------------


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


def test_reconnect_after_restart_delivers_latest_coalesced_writes(api, make_adapter):
    """Writes queued while the API server is down go out after it comes back, in their
    latest coalesced form, one request each; the watch reconnects and catches up."""
    api.add_pod("ml", "p", NODE)
    adapter = make_adapter()
    api.stop()
    wait_until(lambda: not adapter.state()["connected"], what="disconnected")
    adapter.patch_pod_annotations("ml", "p", {"a": "1", "b": "1"})
    adapter.set_node_labels({"gpu-model": "T4"})
    # Both writes were tried and failed while the server is down (each waits out a backoff).
    wait_until(
        lambda: (
            failed_attempt(adapter, ("pod-annotations", "ml", "p"))
            and failed_attempt(adapter, ("node-labels",))
        ),
        what="failed attempts while down",
    )
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


def failed_attempt(adapter, key) -> bool:
    """Whether the write of ``key`` waits for a retry after a failed attempt."""
    with adapter._lock:
        pending = adapter._queue._pending.get(key)
        return pending is not None and pending.last_error is not None


def test_server_errors_are_retried(api, make_adapter):
    """5xx and 429 answers are retried until the write lands."""
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
    """A request that times out is retried without waiting for the hung one."""
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
    """A patch of a pod that is gone (404) is dropped with a log line, never retried."""
    adapter = make_adapter()
    with caplog.at_level(logging.INFO, logger="nodemgr.kubernetes.adapter"):
        adapter.patch_pod_annotations("ml", "gone", {"a": "1"})
        # Nothing pending (or in flight) after the attempt: dropped for good. A retry
        # would have put it back in the queue, so no wait is needed to see there is none.
        wait_until(lambda: adapter.state()["pending_writes"] == 0, what="dropped")
    assert len(requests_of(api, "PATCH", r"/pods/gone$")) == 1  # never retried
    assert any("ml/gone" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)


def test_forbidden_write_is_dropped_and_names_the_rbac(api, make_adapter, caplog):
    """A 403 drops the write with one ERROR naming the RBAC it lacks and deploy/."""
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
    """Node labels: ours under the prefix set exactly as desired (stale ones removed,
    invalid values never sent), foreign labels untouched, nothing patched when in place."""
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
    """gpu-count goes into the node status capacity and allocatable, and out again."""
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
    """Ten refusals in a burst are one Event; after the interval the next one patches
    that Event with the count of all; another reason gets its own Event."""
    pod = api.add_pod("ml", "p", NODE)
    clock = FakeClock(time.time())
    adapter = make_adapter(clock=clock)
    for i in range(10):
        adapter.record_event("ml", "p", "GPUShareRefused", f"no card fits 4 GiB (try {i})")
    wait_until(lambda: len(api.events()) == 1, what="first event")
    # The 9 others were suppressed when recorded (never queued): with the queue empty,
    # nothing more can be posted.
    wait_until(lambda: adapter.state()["pending_writes"] == 0, what="queue empty")
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
    """The calls Allocate makes return in well under 50 ms with the server hung or down."""
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
    """stop() ends both threads within a second, also with requests hung on the server;
    writes after stop are dropped."""
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
    """No credentials: one WARNING naming what was tried, no thread, no error; state says why."""
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
    """kubernetes.enabled false: one INFO line, no thread, nothing queued."""
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
