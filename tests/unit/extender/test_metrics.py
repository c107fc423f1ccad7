"""nodemgr.extender.metrics: the extender's metrics, kept and written by prometheus_client.

Pins: each server's metrics live in a registry of their own (two in one process count
apart, the library's global registry is untouched); a call is counted by verb and result
and its duration falls in the cumulative buckets the extender has always used; the
cache, the watches and the listeners' counts are read at each scrape, not copied; the
text is the library's own exposition."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from nodemgr.extender.metrics import BUCKETS_SECONDS, CONTENT_TYPE, Metrics


class Cache:
    def __init__(self):
        self.numbers = {"nodes": 3, "gpu_nodes": 2, "pods": 5, "assumed": 1}
        self.expired_total = 4
        self.confirmed_total = 6

    def counts(self):
        return dict(self.numbers)


class Watch:
    def __init__(self, synced, watching):
        self.synced, self.watching = synced, watching


def values(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    text = metrics.render().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_calls_are_counted_and_timed_in_the_extenders_buckets():
    """A call counts once under its verb and result, and its duration in every bucket
    from the first whose bound it does not exceed (+Inf: all); sum and count follow."""
    metrics = Metrics(Cache(), {}, dict)
    for seconds in (0.0004, 0.003, 0.003, 3.0):
        metrics.observe("filter", "ok", seconds)
    metrics.observe("bind", "error", 0.2)
    got = values(metrics)
    requests = "gpushare_extender_requests_total"
    assert got[(requests, frozenset({("verb", "filter"), ("result", "ok")}))] == 4
    assert got[(requests, frozenset({("verb", "bind"), ("result", "error")}))] == 1
    buckets = {
        dict(labels)["le"]: value
        for (name, labels), value in got.items()
        if name == "gpushare_extender_request_duration_seconds_bucket"
        and ("verb", "filter") in labels
    }
    expected = {str(bound): (0 if bound < 0.0005 else 1 if bound < 0.005 else 3)
                for bound in BUCKETS_SECONDS}  # fmt: skip
    assert buckets == {**expected, "+Inf": 4}
    filter_verb = frozenset({("verb", "filter")})
    assert got[("gpushare_extender_request_duration_seconds_count", filter_verb)] == 4
    total = got[("gpushare_extender_request_duration_seconds_sum", filter_verb)]
    assert abs(total - 3.0064) < 1e-9


def test_the_cache_watches_and_connections_are_read_at_each_scrape():
    """What the cache holds, the watches' state and the listeners' counts are read when
    scraped: a change shows in the next scrape."""
    cache = Cache()
    watches = {"nodes": Watch(True, True), "pods": Watch(False, False)}
    closed = {("https", "evicted"): 2}
    metrics = Metrics(cache, watches, lambda: closed)
    got = values(metrics)
    assert got[("gpushare_extender_nodes", frozenset())] == 3
    assert got[("gpushare_extender_assumptions_expired_total", frozenset())] == 4
    assert got[("gpushare_extender_assumptions_confirmed_total", frozenset())] == 6
    assert got[("gpushare_extender_cache_synced", frozenset({("resource", "pods")}))] == 0
    assert got[("gpushare_extender_watch_connected", frozenset({("resource", "nodes")}))] == 1
    https_evicted = frozenset({("listener", "https"), ("reason", "evicted")})
    assert got[("gpushare_extender_connections_closed_total", https_evicted)] == 2
    cache.numbers["pods"] = 9
    watches["pods"].synced = True
    closed[("health", "too_large")] = 1
    got = values(metrics)
    assert got[("gpushare_extender_pods", frozenset())] == 9
    assert got[("gpushare_extender_cache_synced", frozenset({("resource", "pods")}))] == 1
    health = frozenset({("listener", "health"), ("reason", "too_large")})
    assert got[("gpushare_extender_connections_closed_total", health)] == 1


def test_each_metrics_has_a_registry_of_its_own():
    """Two servers' metrics in one process count apart, and nothing is registered in the
    library's global registry (a second server would collide there)."""
    before = {family.name for family in REGISTRY.collect()}
    first, second = Metrics(Cache(), {}, dict), Metrics(Cache(), {}, dict)
    first.observe("filter", "ok", 0.001)
    ok = ("gpushare_extender_requests_total", frozenset({("verb", "filter"), ("result", "ok")}))
    assert values(first)[ok] == 1 and ok not in values(second)
    assert {family.name for family in REGISTRY.collect()} == before
    assert not any(name.startswith("gpushare_extender") for name in before)


def test_the_text_is_the_librarys_exposition_format():
    """The content type is the Prometheus text format 0.0.4 the library writes; every
    family has its HELP and TYPE lines."""
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    text = Metrics(Cache(), {}, dict).render().decode()
    assert "# TYPE gpushare_extender_nodes gauge\n" in text
    assert "# HELP gpushare_extender_pods Pods asking for GPUs in the cache.\n" in text
