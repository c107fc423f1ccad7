"""The Prometheus endpoint: what the node's cards and allocations look like, and how
the daemon's hot paths behave.

One collector reads, at scrape time, the status document (``snapshot()``: a value it
gives as None is left out, never exported as 0), the Allocate and prepare latency
histograms and the reconcile counters (fed through plain callbacks). Counters and
histograms are kept by hand: prometheus_client's add ``_created`` series and hide their
values behind private API.

What it must not do: import anything of the daemon beyond errors (the daemon
wires it), use prometheus_client's global registry (tests make many Metrics in
one process), or let a failing snapshot break the scrape of everything else.
With nodemgr.extender.metrics, the only modules that import prometheus_client.

Longer than 400 lines: every metric family Grafana and operators rely on is built here.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from nodemgr.status.http import MetricsServer, bind_wsgi

if TYPE_CHECKING:
    from nodemgr.domain.reconcile import ReconcilePlan

log = logging.getLogger(__name__)

MIB_BYTES = 1024 * 1024

# Allocate is in-memory work plus one SQLite commit: under a millisecond to a few ms,
# tens on a busy disk. A second is pathological (pods wait on it), so the buckets stop
# soon after.
ALLOCATE_BUCKETS_SECONDS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
_BUCKET_LE = (*(repr(b) for b in ALLOCATE_BUCKETS_SECONDS), "+Inf")
_PREPARE = "\0dra-prepare"  # NodePrepareResources in the same buckets (not a resource name)

RECONCILE_RESULTS = ("ok", "skipped", "failed")
CARD_MODES = ("shared", "whole", "idle")
ENFORCEMENT_ACTIONS = ("kill", "log")
VIOLATION_KINDS = ("memory", "env", "unallocated", "mps_control")
MPS_STATES = (
    "healthy", "starting", "down", "hung", "broken", "fault", "off", "disabled", "unknown",
)  # fmt: skip
# gpushare_gpu_mps_up is left out in these, so an alert on `gpushare_gpu_mps_up == 0`
# means "MPS should be up and is not"; gpushare_gpu_mps_state still shows them.
MPS_UP_ABSENT = frozenset({"off", "disabled", "unknown"})

CARD_LABELS = ("gpu", "index", "model")
# Named by owner, never by id: the id is a credential the hook accepts, and every local
# user reads this endpoint. Those without a known owner yet are added up per card and
# mode.
ALLOCATION_LABELS = ("namespace", "pod", "container", "gpu", "mode")
ISOLATION_LABELS = (*ALLOCATION_LABELS, "memory", "compute")
# A claim may serve several pods; claims are not in the gpushare_allocation_* families.
CLAIM_LABELS = ("namespace", "claim", "gpu", "mode")
CLAIM_ISOLATION_LABELS = (*CLAIM_LABELS, "memory", "compute")
PREPARE_RESULTS = ("ok", "refused")


class Metrics:
    """``snapshot`` is called once per scrape, from the HTTP server's thread: it must be
    cheap and thread-safe."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _Collector(snapshot)
        self.registry.register(self._collector)

    def observe_allocate(self, resource: str, seconds: float, ok: bool) -> None:
        self._collector.observe_allocate(resource, seconds, ok)

    def observe_prepare(self, seconds: float, ok: bool) -> None:
        """``seconds`` include its claims' reads from the API server."""
        self._collector.observe_prepare(seconds, ok)

    def count_reconcile(self, result: str) -> None:
        """``ok``, ``skipped`` (kubelet unavailable) or ``failed``."""
        if result not in RECONCILE_RESULTS:
            raise ValueError(f"reconcile result must be one of {RECONCILE_RESULTS}: {result!r}")
        self._collector.count_reconcile(result)

    def count_reconcile_plan(self, plan: ReconcilePlan) -> None:
        self._collector.count_reconcile_changes(released=len(plan.delete), updated=len(plan.put))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, address: str) -> MetricsServer:
        """Serve ``GET /metrics`` (see ``http.bind_wsgi``)."""
        server = self.bind(address)
        server.start()
        return server

    def bind(self, address: str) -> MetricsServer:
        server = bind_wsgi(address, make_wsgi_app(self.registry))
        log.info("serving metrics on http://%s/metrics", server.url_host_port)
        return server


class _Collector:
    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]):
        self._snapshot = snapshot
        self._lock = threading.Lock()  # observe/count run on gRPC and daemon threads
        # (resource, result) -> (count per bucket, not cumulative, the last for +Inf; [sum])
        self._allocate: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
        self._reconcile = dict.fromkeys(RECONCILE_RESULTS, 0)
        self._released = 0
        self._updated = 0
        self._scrape_errors = 0
        self._last_error: str | None = None

    # --- fed by the daemon ---------------------------------------------------------

    def observe_allocate(self, resource: str, seconds: float, ok: bool) -> None:
        key = (resource, "ok" if ok else "error")
        slot = bisect.bisect_left(ALLOCATE_BUCKETS_SECONDS, seconds)  # le is inclusive
        with self._lock:
            counts, total = self._allocate.setdefault(
                key, ([0] * (len(ALLOCATE_BUCKETS_SECONDS) + 1), [0.0])
            )
            counts[slot] += 1
            total[0] += seconds

    def observe_prepare(self, seconds: float, ok: bool) -> None:
        self.observe_allocate(_PREPARE, seconds, ok)

    def count_reconcile(self, result: str) -> None:
        with self._lock:
            self._reconcile[result] += 1

    def count_reconcile_changes(self, released: int, updated: int) -> None:
        with self._lock:
            self._released += released
            self._updated += updated

    # --- read by the registry ------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        try:
            # Built whole before yielding: a document breaking halfway gives no half-truths.
            from_snapshot = list(_from_document(self._snapshot()))
        except Exception as e:
            from_snapshot = []
            self._snapshot_failed(e)
        else:
            self._last_error = None
        yield from from_snapshot
        yield from self._own()

    def _snapshot_failed(self, e: Exception) -> None:
        with self._lock:
            self._scrape_errors += 1
        # Once per distinct failure, not once per scrape: scrapers call every 15 s.
        if repr(e) != self._last_error:
            self._last_error = repr(e)
            log.error("metrics: the status snapshot failed; exporting the rest", exc_info=e)

    def _own(self) -> Iterator[Metric]:
        with self._lock:
            allocate = {k: (list(c), t[0]) for k, (c, t) in self._allocate.items()}
            reconcile = dict(self._reconcile)
            released, updated, errors = self._released, self._updated, self._scrape_errors

        histogram = HistogramMetricFamily(
            "gpushare_allocate_duration_seconds",
            "Time the device plugin took to answer kubelet's Allocate, by resource and "
            "result (ok, or error: refused or failed).",
            labels=("resource", "result"),
        )
        prepare = HistogramMetricFamily(
            "gpushare_dra_prepare_duration_seconds",
            "Time a NodePrepareResources call took (reading its claims from the API server, "
            "judging and recording them, writing their CDI specs), by result: ok, or "
            "refused (a claim of it was).",
            labels=("result",),
        )
        for (resource, result), (counts, total) in sorted(allocate.items()):
            buckets, cumulative = [], 0
            for bound, count in zip(_BUCKET_LE, counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            if resource == _PREPARE:
                prepare.add_metric(("ok" if result == "ok" else "refused",), buckets, total)
            else:
                histogram.add_metric((resource, result), buckets, total)
        yield histogram
        yield prepare

        counter = CounterMetricFamily(
            "gpushare_reconcile",
            "Comparisons of the ledger with kubelet's PodResources record, by result: ok, "
            "skipped (kubelet unavailable, nothing released), failed.",
            labels=("result",),
        )
        for result in RECONCILE_RESULTS:
            counter.add_metric((result,), reconcile[result])
        yield counter
        yield CounterMetricFamily(
            "gpushare_reconcile_allocations_released",
            "Allocations released by reconcile because kubelet no longer reports them.",
            value=released,
        )
        yield CounterMetricFamily(
            "gpushare_reconcile_allocations_updated",
            "Allocations written by reconcile from kubelet's record: owner filled in, devices "
            "corrected, split off or adopted.",
            value=updated,
        )
        yield CounterMetricFamily(
            "gpushare_scrape_errors",
            "Scrapes in which the status snapshot failed; its metrics were left out.",
            value=errors,
        )


def _from_document(doc: Mapping[str, Any]) -> Iterator[Metric]:
    """A KeyError/TypeError means a bad document; a null section is left out."""
    daemon = doc["daemon"]
    if daemon is not None:
        yield GaugeMetricFamily(
            "gpushare_daemon_ready",
            "1 when the daemon serves kubelet (registered), 0 while it is starting.",
            value=int(bool(daemon["ready"])),
        )
        info = GaugeMetricFamily(
            "gpushare_build_info",
            "Always 1; the gpushare-node version and the node name it runs as.",
            labels=("version", "node"),
        )
        info.add_metric((str(daemon["version"]), str(doc["node"])), 1)
        yield info
        yield from _workers(daemon)
        if daemon.get("dra") is not None:
            yield from _dra(daemon["dra"])
        yield from _listeners(daemon.get("listeners") or {})
    yield from _cards(doc["gpus"])
    plugin = [a for a in doc["allocations"] if not a.get("claim")]
    yield from _allocations(plugin)
    yield from _claims([a for a in doc["allocations"] if a.get("claim")])
    if doc["enforcement"] is not None:
        yield from _enforcement(doc["enforcement"])


def _workers(daemon: Mapping[str, Any]) -> Iterator[Metric]:
    if daemon.get("healthy") is not None:
        yield GaugeMetricFamily(
            "gpushare_daemon_healthy",
            "1 while every background worker runs and can do its job; 0 while one is down "
            "or cannot (the enforcement watchdog unable to judge); systemd then gets no "
            "watchdog ping and restarts the daemon. The status document's daemon.problems "
            "says why.",
            value=int(bool(daemon["healthy"])),
        )
    workers = daemon.get("workers")
    if not workers:
        return
    up = _gauge(
        "gpushare_worker_up",
        "1 while the background worker runs (enforcement watchdog, MPS supervisor, servers); "
        "0 while it is down: dead, or waiting to be restarted.",
        ("worker",),
    )
    restarts = CounterMetricFamily(
        "gpushare_worker_restarts",
        "Times the background worker died and was started again since the daemon started.",
        labels=("worker",),
    )
    for name, health in sorted(workers.items()):
        up.add_metric((str(name),), int(bool(health["up"])))
        restarts.add_metric((str(name),), health["restarts"])
    yield up
    yield restarts


def _listeners(listeners: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    if not listeners:
        return
    connections = _gauge(
        "gpushare_listener_connections",
        "Connections the listener serves now (absent when not known: the device plugin sockets).",
        ("listener",),
    )
    cap = _gauge(
        "gpushare_listener_max_connections",
        "The listener's connection cap: more at once are closed at once, unread.",
        ("listener",),
    )
    refused = CounterMetricFamily(
        "gpushare_listener_refused",
        "Connections the listener closed without serving them whole, by reason: cap (over "
        "its connection cap, closed unread), deadline (cut at its per-connection deadline), "
        "slow (the request did not arrive whole in time), too_large (over its byte limit), "
        "malformed (not a request).",
        labels=("listener", "reason"),
    )
    for name, stats in sorted(listeners.items()):
        if stats["connections"] is not None:
            connections.add_metric((str(name),), stats["connections"])
        cap.add_metric((str(name),), stats["max_connections"])
        for reason, count in sorted(stats["refused"].items()):
            refused.add_metric((str(name), str(reason)), count)
    yield from (connections, cap, refused)


def _cards(cards: list[Mapping[str, Any]]) -> Iterator[Metric]:
    total = _gauge("gpushare_gpu_memory_total_bytes", "Memory of the card.", CARD_LABELS)
    allocated = _gauge(
        "gpushare_gpu_memory_allocated_bytes",
        "Memory of the card given to containers (quotas; a whole card counts in full).",
        CARD_LABELS,
    )
    used = _gauge(
        "gpushare_gpu_memory_used_bytes",
        "Memory the card's processes hold (absent when unknown).",
        CARD_LABELS,
    )
    core = _gauge(
        "gpushare_gpu_core_allocated_ratio",
        "Compute share of the card given to containers (0-1; 1 = all SMs).",
        CARD_LABELS,
    )
    mode = _gauge(
        "gpushare_gpu_mode",
        "1 for the card's current mode (shared, whole, idle), 0 for the others.",
        (*CARD_LABELS, "mode"),
    )
    healthy = _gauge(
        "gpushare_gpu_healthy",
        "1 when the card can be handed out as advertised, 0 when its devices are Unhealthy "
        "(absent when unknown).",
        CARD_LABELS,
    )
    count = _gauge("gpushare_gpu_allocations", "Allocations on the card.", CARD_LABELS)
    mps_up = _gauge(
        "gpushare_gpu_mps_up",
        "1 when the card's MPS control daemon is healthy, 0 when it is starting, down, "
        "hung, broken or its server faulted; absent when MPS is not meant to run (off, "
        "disabled) or its state is unknown.",
        CARD_LABELS,
    )
    mps_state = _gauge(
        "gpushare_gpu_mps_state",
        "1 for the MPS state of the card, 0 for the other states.",
        (*CARD_LABELS, "state"),
    )
    clients = _gauge(
        "gpushare_gpu_mps_clients", "MPS clients on the card (absent when unknown).", CARD_LABELS
    )
    for card in cards:
        labels = (str(card["uuid"]), str(card["index"]), str(card["model"]))
        total.add_metric(labels, card["memory_total_mib"] * MIB_BYTES)
        allocated.add_metric(labels, card["memory_allocated_mib"] * MIB_BYTES)
        if card["memory_used_mib"] is not None:
            used.add_metric(labels, card["memory_used_mib"] * MIB_BYTES)
        core.add_metric(labels, card["core_allocated_percent"] / 100)
        _one_hot(mode, labels, CARD_MODES, card["mode"])
        if card["healthy"] is not None:
            healthy.add_metric(labels, int(card["healthy"]))
        count.add_metric(labels, card["allocations"])
        mps = card["mps"]
        state = mps["state"]
        if state not in MPS_UP_ABSENT:
            # A state this code does not know is read as "not healthy": an alert
            # should fire on it rather than stay silent.
            mps_up.add_metric(labels, int(state == "healthy"))
        _one_hot(mps_state, labels, MPS_STATES, state)
        if mps["clients"] is not None:
            clients.add_metric(labels, mps["clients"])
    yield from (total, allocated, used, core, mode, healthy, count, mps_up, mps_state, clients)


def _allocations(allocations: list[Mapping[str, Any]]) -> Iterator[Metric]:
    quota = _gauge(
        "gpushare_allocation_memory_quota_bytes",
        "Memory quota of the allocation (whole cards: their memory).",
        ALLOCATION_LABELS,
    )
    used = _gauge(
        "gpushare_allocation_memory_used_bytes",
        "Memory the allocation's processes hold (absent when unknown).",
        ALLOCATION_LABELS,
    )
    core = _gauge(
        "gpushare_allocation_core_quota_ratio",
        "Compute share of the allocation (0-1 of a card; whole cards: 1 per card).",
        ALLOCATION_LABELS,
    )
    confirmed = _gauge(
        "gpushare_allocation_confirmed",
        "1 when kubelet's record confirms the allocation, 0 while it is pending.",
        ALLOCATION_LABELS,
    )
    containers = _gauge(
        "gpushare_allocation_containers",
        "Containers the runtime hook registered for the allocation.",
        ALLOCATION_LABELS,
    )
    violations = _gauge(
        "gpushare_allocation_violations",
        "Violations recorded for the allocation in the ledger (a gauge: the ledger keeps "
        "the newest 10,000 only).",
        ALLOCATION_LABELS,
    )
    started = _gauge(
        "gpushare_allocation_start_time_seconds",
        "When the allocation was made (Unix time).",
        ALLOCATION_LABELS,
    )
    isolation = _gauge(
        "gpushare_allocation_isolation",
        "Always 1: what the node really enforces for the allocation now, memory (exclusive, "
        "enforced, watched, advisory, unlimited) and compute (exclusive, advisory, unlimited); "
        "see docs/isolation.md.",
        ISOLATION_LABELS,
    )
    for labels, merged in _by_owner(allocations).items():
        quota.add_metric(labels, merged["memory_mib"] * MIB_BYTES)
        if merged["memory_used_mib"] is not None:
            used.add_metric(labels, merged["memory_used_mib"] * MIB_BYTES)
        core.add_metric(labels, merged["core_percent"] / 100)
        confirmed.add_metric(labels, int(merged["confirmed"]))
        containers.add_metric(labels, merged["containers"])
        violations.add_metric(labels, merged["violations"])
        started.add_metric(labels, merged["created_at"])
        for levels in sorted(merged["isolation"]):
            isolation.add_metric((*labels, *levels), 1)
    yield from (quota, used, core, confirmed, containers, violations, started, isolation)


def _dra(dra: Mapping[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "gpushare_dra_registered",
        "1 when kubelet registered the DRA plugin, 0 when it refused it or has not yet.",
        value=int(dra.get("registered") is True),
    )
    yield GaugeMetricFamily(
        "gpushare_dra_serving",
        "1 while the DRA plugin serves its registration and DRA sockets.",
        value=int(bool(dra.get("serving"))),
    )


def _claims(claims: list[Mapping[str, Any]]) -> Iterator[Metric]:
    quota = _gauge(
        "gpushare_claim_memory_quota_bytes",
        "Memory quota of a DRA claim (whole cards: their memory).",
        CLAIM_LABELS,
    )
    used = _gauge(
        "gpushare_claim_memory_used_bytes",
        "Memory the claim's processes hold, all its pods together (absent when unknown).",
        CLAIM_LABELS,
    )
    core = _gauge(
        "gpushare_claim_core_quota_ratio",
        "Compute share of a DRA claim (0-1 of a card; whole cards: 1 per card).",
        CLAIM_LABELS,
    )
    containers = _gauge(
        "gpushare_claim_containers",
        "Containers the runtime hook registered for the claim (of all its pods).",
        CLAIM_LABELS,
    )
    isolation = _gauge(
        "gpushare_claim_isolation",
        "Always 1: what the node really enforces for the claim now (as "
        "gpushare_allocation_isolation).",
        CLAIM_ISOLATION_LABELS,
    )
    for a in claims:
        labels = (
            str(a["claim"]["namespace"]),
            str(a["claim"]["name"]),
            str(a["gpu"]),
            "whole" if a["whole"] else "shared",
        )
        quota.add_metric(labels, a["memory_mib"] * MIB_BYTES)
        if a["memory_used_mib"] is not None:
            used.add_metric(labels, a["memory_used_mib"] * MIB_BYTES)
        core.add_metric(labels, a["core_percent"] / 100)
        containers.add_metric(labels, a["containers"])
        if a.get("isolation"):
            levels = (a["isolation"]["memory"], a["isolation"]["compute"])
            isolation.add_metric((*labels, *levels), 1)
    yield from (quota, used, core, containers, isolation)


def _by_owner(allocations: list[Mapping[str, Any]]) -> dict[tuple[str, ...], dict[str, Any]]:
    """Those sharing label values (owners not known yet) added up: confirmed only when
    all are, the earliest start, use unknown when any is."""
    merged: dict[tuple[str, ...], dict[str, Any]] = {}
    for a in allocations:
        labels = (
            a["namespace"] or "",  # unknown owner: an empty label, which PromQL reads as absent
            a["pod"] or "",
            a["container"] or "",
            str(a["gpu"]),
            "whole" if a["whole"] else "shared",
        )
        isolation = a.get("isolation")  # null or absent while unknown
        levels = {(isolation["memory"], isolation["compute"])} if isolation else set()
        row = {
            "memory_mib": a["memory_mib"],
            "memory_used_mib": a["memory_used_mib"],
            "core_percent": a["core_percent"],
            "confirmed": a["state"] == "confirmed",
            "containers": a["containers"],
            "violations": a["violations"],
            "created_at": a["created_at"],
            "isolation": levels,
        }
        into = merged.setdefault(labels, row)
        if into is row:
            continue
        for key in ("memory_mib", "core_percent", "containers", "violations"):
            into[key] += row[key]
        known = into["memory_used_mib"] is not None and row["memory_used_mib"] is not None
        into["memory_used_mib"] = (
            into["memory_used_mib"] + row["memory_used_mib"] if known else None
        )
        into["confirmed"] = into["confirmed"] and row["confirmed"]
        into["created_at"] = min(into["created_at"], row["created_at"])
        into["isolation"] = into["isolation"] | levels
    return merged


def _enforcement(enforcement: Mapping[str, Any]) -> Iterator[Metric]:
    action = _gauge(
        "gpushare_enforcement_action",
        "1 for the configured enforcement action (kill, log), 0 for the other.",
        ("action",),
    )
    _one_hot(action, (), ENFORCEMENT_ACTIONS, enforcement["action"])
    yield action
    violations = CounterMetricFamily(
        "gpushare_enforcement_violations",
        "Violation onsets the watchdog found since the daemon started, by kind: memory "
        "(over quota), env (quota env missing or raised), unallocated (GPU process outside "
        "any allocation), mps_control (a process holding its card's MPS control daemon: "
        "connected to its control socket, sending nothing).",
        labels=("kind",),
    )
    counts = enforcement["violations"]
    for kind in sorted({*VIOLATION_KINDS, *counts}):
        violations.add_metric((kind,), counts.get(kind, 0))
    yield violations
    yield CounterMetricFamily(
        "gpushare_enforcement_kills",
        "Processes the watchdog killed since the daemon started.",
        value=enforcement["kills"],
    )
    if enforcement.get("judging") is not None:
        yield GaugeMetricFamily(
            "gpushare_enforcement_judging",
            "1 when the watchdog's last scan judged every GPU process; 0 when it could not "
            "(per-process GPU memory or /proc unreadable, a kill impossible): the daemon is "
            "then unhealthy and refuses new GPU containers until a scan judges again.",
            value=int(bool(enforcement["judging"])),
        )
    if enforcement.get("failed_scans") is not None:
        yield CounterMetricFamily(
            "gpushare_enforcement_failed_scans",
            "Watchdog scans that could not judge the GPU processes and failed closed.",
            value=enforcement["failed_scans"],
        )
    if enforcement.get("unreadable_processes") is not None:
        yield CounterMetricFamily(
            "gpushare_enforcement_unreadable_processes",
            "GPU processes whose /proc files could not be read (not UTF-8, too large), each "
            "counted once; they are judged as belonging to no container.",
            value=enforcement["unreadable_processes"],
        )


def _gauge(name: str, doc: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _one_hot(family: GaugeMetricFamily, labels: tuple[str, ...], known, current: str) -> None:
    states = known if current in known else (*known, current)
    for state in states:
        family.add_metric((*labels, state), int(state == current))
