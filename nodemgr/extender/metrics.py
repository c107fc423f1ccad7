"""The extender's Prometheus metrics, kept and written by prometheus_client.

Calls by verb and result, and their durations, are fed as each is answered; the cache,
the watches and the listeners' refusals are read at each scrape. Counters and
histograms have prometheus_client's ``_created`` series.

What it must not do: use the library's global registry, or name a series
after anything a client sent (labels come from fixed sets: verbs, results,
resources, listeners and reasons).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class CacheCounts(Protocol):
    """nodemgr.extender.cache.ClusterCache"""

    expired_total: int
    confirmed_total: int

    def counts(self) -> dict[str, int]: ...


class WatchState(Protocol):
    @property
    def watching(self) -> bool: ...

    @property
    def synced(self) -> bool: ...


class Metrics:
    """``closed_connections``: (listener, reason) -> count, asked at each scrape."""

    def __init__(
        self,
        cache: CacheCounts,
        watches: Mapping[str, WatchState],
        closed_connections: Callable[[], Mapping[tuple[str, str], int]],
    ):
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "gpushare_extender_requests",
            "Extender calls by verb and result.",
            ("verb", "result"),
            registry=self.registry,
        )
        self._durations = Histogram(
            "gpushare_extender_request_duration_seconds",
            "Time to answer a call, API requests of bind included.",
            ("verb",),
            buckets=BUCKETS_SECONDS,
            registry=self.registry,
        )
        self.registry.register(_ScrapeTime(cache, watches, closed_connections))

    def observe(self, verb: str, result: str, seconds: float) -> None:
        self._requests.labels(verb, result).inc()
        self._durations.labels(verb).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ScrapeTime(Collector):
    def __init__(
        self,
        cache: CacheCounts,
        watches: Mapping[str, WatchState],
        closed_connections: Callable[[], Mapping[tuple[str, str], int]],
    ):
        self._cache = cache
        self._watches = watches
        self._closed_connections = closed_connections

    def collect(self) -> Iterator[Metric]:
        cache = self._cache
        counts = cache.counts()
        for name, help_text, value in (
            ("gpushare_extender_nodes", "Nodes in the cache.", counts["nodes"]),
            (
                "gpushare_extender_gpu_nodes",
                "Nodes whose gpushare-node published its GPUs.",
                counts["gpu_nodes"],
            ),
            ("gpushare_extender_pods", "Pods asking for GPUs in the cache.", counts["pods"]),
            (
                "gpushare_extender_assumed_pods",
                "Binds decided and not yet seen bound by the pod watch.",
                counts["assumed"],
            ),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)
        synced = GaugeMetricFamily(
            "gpushare_extender_cache_synced",
            "Whether the resource was listed (1) or not.",
            labels=("resource",),
        )
        connected = GaugeMetricFamily(
            "gpushare_extender_watch_connected",
            "Whether the resource's watch is open.",
            labels=("resource",),
        )
        for resource, watch in sorted(self._watches.items()):
            synced.add_metric((resource,), int(watch.synced))
            connected.add_metric((resource,), int(watch.watching))
        yield synced
        yield connected
        yield CounterMetricFamily(
            "gpushare_extender_assumptions_expired",
            "Assumed binds the pod watch never confirmed.",
            value=cache.expired_total,
        )
        yield CounterMetricFamily(
            "gpushare_extender_assumptions_confirmed",
            "Assumed binds the pod watch confirmed.",
            value=cache.confirmed_total,
        )
        closed = CounterMetricFamily(
            "gpushare_extender_connections_closed",
            "Connections refused or cut, by listener and reason (handshake_failed, "
            "not_authorized, over_capacity, evicted, *_timeout, too_large, busy, "
            "bad_request, ...).",
            labels=("listener", "reason"),
        )
        for (listener, reason), n in sorted(self._closed_connections().items()):
            closed.add_metric((listener, reason), n)
        yield closed
