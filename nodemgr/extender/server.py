"""The extender's verbs over the cache, and the HTTP server kube-scheduler calls.

``bind`` binds only a pod named by its real UID to a node that passed this extender's
filter for it, never one already bound: it chooses and assumes the cards under the
cache lock, then writes the gpushare annotations and the signed placement in one merge
patch and creates the Binding. A bind that fails for sure frees its cards; one with an
unknown outcome keeps them until the assumption expires. Until the cache has listed
nodes and pods, filter and bind answer ``Error`` (kube-scheduler retries), never a
blind decision.

``ExtenderServer``: the verbs (``POST <prefix>/filter``, ``/prioritize``, ``/bind``, the
bare paths too), ``GET /healthz`` and ``GET /metrics`` over mutual TLS only; on a plain
port, for kubelet's probes (which present no client certificate), ``/healthz`` and
``/metrics`` only. A body not of the verb's type, or over ``wire.Limits``, gets 400 (413
unread when its length says so) with the reason.

What it must not do: make an API request while holding the cache lock.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from nodemgr.domain.extenderchoice import signed_message, signed_text, with_signature
from nodemgr.errors import KubeApiError, KubeUnavailable
from nodemgr.extender import logic
from nodemgr.extender.cache import ClusterCache
from nodemgr.extender.listener import Budget, Listener, Request, Response, Serving, Stats
from nodemgr.extender.metrics import CONTENT_TYPE, Metrics, WatchState
from nodemgr.extender.tls import ServerTls
from nodemgr.extender.wire import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderFilterResult,
    HostPriority,
    Limits,
    WireError,
    binding_result,
    host_priority_list,
    parse_binding_args,
    parse_extender_args,
)
from nodemgr.kubernetes.podwatch import pod_info

log = logging.getLogger("nodemgr.extender")

# kubelet's probes and a scraper: small GETs, one per connection.
HEALTH_BUDGET = Budget(
    max_connections=32,
    idle_seconds=5.0,
    header_seconds=5.0,
    body_seconds=5.0,
    write_seconds=5.0,
    max_header_bytes=4096,
    max_body_bytes=0,
    keep_alive=False,
    workers=1,
)
NOT_SYNCED = (
    "gpushare-scheduler has not listed the cluster's nodes and pods yet (starting, or the API "
    "server does not answer); kube-scheduler retries the pod"
)


class Signer(Protocol):
    """nodemgr.common.placementkey.PrivateKey"""

    def sign(self, message: bytes) -> bytes: ...


class Binder(Protocol):
    """The two writes of a bind (nodemgr.kubernetes.scheduling with a session)."""

    def annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None: ...

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None: ...


class Extender:
    def __init__(
        self,
        cache: ClusterCache,
        binder: Binder,
        signer: Signer,
        clock_ns: Callable[[], int] = time.time_ns,
    ):
        self.cache = cache
        self.binder = binder
        self.signer = signer
        self._clock_ns = clock_ns
        self.decision_seconds: list[float] = []  # bind's time under the lock (bench reads it)
        self.keep_decision_times = False

    def _demand(self, args: ExtenderArgs) -> logic.PodDemand:
        return logic.pod_demand(pod_info(args.pod), self.cache.resources)

    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        cache = self.cache
        if not cache.synced:
            return ExtenderFilterResult(error=NOT_SYNCED)
        demand = self._demand(args)
        names = args.candidate_names()
        if not demand.wants_gpu:
            passed = names
            outcome = logic.FilterOutcome(list(names), {}, {})
        else:
            cache.expire()
            with cache.lock:
                outcome = logic.filter_nodes(
                    demand,
                    names,
                    cache.view,
                    cache.policy,
                    cache.resources.memory_unit_mib,
                )
            passed = outcome.passed
            if not passed:
                reasons = {**outcome.failed, **outcome.unresolvable}
                log.info(
                    "%s fits none of %d nodes: %s",
                    demand.label,
                    len(names),
                    "; ".join(f"{n}: {r}" for n, r in reasons.items())[:2000],
                )
        cache.remember(demand, passed)
        result = ExtenderFilterResult(
            failed_nodes=outcome.failed, failed_and_unresolvable_nodes=outcome.unresolvable
        )
        if args.node_names is not None:
            result.node_names = list(passed)
        else:
            keep = set(passed)
            result.nodes = [n for n in args.nodes or [] if n["metadata"]["name"] in keep]
        return result

    def prioritize(self, args: ExtenderArgs) -> list[HostPriority]:
        cache = self.cache
        names = args.candidate_names()
        if not cache.synced:
            return [HostPriority(n, 0) for n in names]
        demand = self._demand(args)
        if not demand.wants_gpu:
            return [HostPriority(n, 0) for n in names]
        with cache.lock:
            scores = logic.prioritize(
                demand, names, cache.view, cache.policy, cache.resources.memory_unit_mib
            )
        return [HostPriority(n, s) for n, s in scores]

    def bind(self, args: ExtenderBindingArgs) -> str:
        """ "" when done, else the error kube-scheduler reports."""
        cache = self.cache
        who = f"{args.pod_namespace}/{args.pod_name}"
        if not cache.synced:
            return NOT_SYNCED
        if not args.pod_uid:
            return f"gpushare-scheduler binds a pod by its UID only: the bind of {who} names none"
        cache.expire()
        began = time.perf_counter()
        with cache.lock:
            decided = self._decide(args, who)
        if isinstance(decided, str):
            return decided
        if self.keep_decision_times:
            self.decision_seconds.append(time.perf_counter() - began)
        demand, annotations = decided
        try:
            if annotations:
                self.binder.annotate(args.pod_namespace, args.pod_name, annotations)
            self.binder.bind(args.pod_namespace, args.pod_name, demand.uid, args.node)
        except KubeApiError as e:
            if isinstance(e, KubeUnavailable):
                cache.bound(demand.uid)  # it may have happened: keep the cards until expiry
            else:
                cache.forget(demand.uid)
            log.warning("binding %s to %s failed: %s", who, args.node, e)
            return f"gpushare-scheduler could not bind {who} to {args.node}: {e}"
        if demand.wants_gpu:
            cache.bound(demand.uid)
            log.info(
                "bound %s to %s: %s",
                who,
                args.node,
                ", ".join(_describe_choice(demand, annotations)) or "whole cards only",
            )
        return ""

    def _decide(
        self, args: ExtenderBindingArgs, who: str
    ) -> str | tuple[logic.PodDemand, dict[str, str]]:
        """Under the cache lock: the refusal, or the demand and the annotations to write
        (its cards then assumed)."""
        cache = self.cache
        demand = cache.demand_for_bind(args.pod_namespace, args.pod_name, args.pod_uid)
        if demand is None:
            return (
                f"gpushare-scheduler does not know pod {who} with UID {args.pod_uid}: "
                "neither its pod watch nor a filter call has shown it"
            )
        record = cache.pod(args.pod_namespace, args.pod_name)
        if record is not None and record.node:
            return f"{who} is already bound to {record.node}"
        if not cache.passed_filter(demand.uid, args.node):
            return (
                f"{args.node} did not pass gpushare-scheduler's filter for {who} (UID "
                f"{demand.uid}): kube-scheduler filters the pod again"
            )
        if not demand.wants_gpu:
            return demand, {}
        view = cache.view(args.node)
        try:
            placement = logic.place(demand, view, cache.policy, cache.resources.memory_unit_mib)
        except logic.Unfit as e:
            return f"{who} no longer fits {args.node}: {e.reason}"
        now_ns = self._clock_ns()
        annotations = logic.bind_annotations(demand, placement, view, now_ns)
        if annotations:
            try:
                text = signed_text(demand.uid, args.node, now_ns, placement.cards)
            except ValueError as e:
                return f"gpushare-scheduler cannot bind {who}: {e}"
            signature = self.signer.sign(signed_message(text))
            annotations[cache.trust.signed_key] = with_signature(text, signature)
        cache.assume(placement, demand)
        return demand, annotations


def _describe_choice(demand: logic.PodDemand, annotations: dict[str, str]) -> list[str]:
    text = annotations.get(logic.ALLOCATION_ANNOTATION)
    chosen = json.loads(text) if text else {}
    parts = []
    for c in demand.containers:
        cards = chosen.get(str(c.index))
        if cards:
            (card,) = cards
            parts.append(f"{c.name} on GPU{card} ({c.memory_units} units, {c.core_percent}%)")
        if c.whole:
            parts.append(f"{c.name}: {c.whole} whole")
    return parts


# --- HTTP ------------------------------------------------------------------------------------


class ExtenderServer:
    """``address``: HTTPS, every verb; ``health_address`` (optional): plain HTTP, read-only,
    no pod names."""

    def __init__(
        self,
        extender: Extender,
        address: tuple[str, int],
        url_prefix: str = "",
        watches: dict[str, WatchState] | None = None,
        *,
        tls: ServerTls,
        health_address: tuple[str, int] | None = None,
        limits: Limits | None = None,
        budget: Budget | None = None,
        health_budget: Budget | None = None,
    ):
        self.extender = extender
        self.watches = watches or {}
        self.limits = limits or Limits()
        self.url_prefix = "/" + url_prefix.strip("/") if url_prefix.strip("/") else ""
        self.stats = Stats()
        self.metrics = Metrics(
            extender.cache,
            self.watches,
            lambda: self.serving.call(lambda: dict(self.stats.counts)),  # the loop's thread
        )
        budget = budget or Budget(max_body_bytes=self.limits.max_body_bytes)
        self.serving = Serving()
        self.serving.listeners.append(
            Listener("https", address, self._handle, budget, tls, self.stats)
        )
        if health_address is not None:
            health = health_budget or HEALTH_BUDGET
            self.serving.listeners.append(
                Listener("health", health_address, self._handle_health, health, None, self.stats)
            )

    @property
    def address(self) -> tuple[str, int]:
        return self.serving.listeners[0].address

    @property
    def health_address(self) -> tuple[str, int] | None:
        listeners = self.serving.listeners
        return listeners[1].address if len(listeners) > 1 else None

    def start(self) -> None:
        self.serving.start()

    def shutdown(self) -> None:
        self.serving.stop()

    def route(self, method: str, path: str) -> str | None:
        path = path.split("?", 1)[0].rstrip("/")
        if self.url_prefix and path.startswith(self.url_prefix + "/"):
            path = path[len(self.url_prefix) :]
        verb = path.lstrip("/")
        if verb in ("filter", "prioritize", "bind") and method == "POST":
            return verb
        if verb in ("healthz", "metrics") and method == "GET":
            return verb
        if verb in ("filter", "prioritize", "bind", "healthz", "metrics"):
            return "method"
        return None

    def healthz(self) -> tuple[int, str]:
        cache = self.extender.cache
        missing = [
            resource
            for resource, synced in (("nodes", cache.nodes_synced), ("pods", cache.pods_synced))
            if not synced
        ]
        if missing:
            return 503, f"not ready: {' and '.join(missing)} not listed yet\n"
        return 200, "ok\n"

    def answer(self, verb: str, body: bytes) -> tuple[int, Any, str]:
        extender = self.extender
        try:
            if verb == "filter":
                result = extender.filter(parse_extender_args(body, self.limits))
                passed = result.node_names or result.nodes
                label = "error" if result.error else "ok" if passed else "none"
                return 200, result.to_json(), label
            if verb == "prioritize":
                args = parse_extender_args(body, self.limits)
                return 200, host_priority_list(extender.prioritize(args)), "ok"
            error = extender.bind(parse_binding_args(body, self.limits))
            return 200, binding_result(error), "error" if error else "ok"
        except WireError as e:
            return 400, {"error": str(e)}, "bad_request"

    # --- the handlers (worker threads) ---------------------------------------------------

    def _handle(self, request: Request) -> Response:
        verb = self.route(request.method, request.target)
        if verb is None:
            return _text(404, f"no such path: {request.target[:200]}\n")
        if verb == "method":
            return _text(405, f"{request.method} not allowed on {request.target[:200]}\n")
        if verb == "healthz":
            status, text = self.healthz()
            return _text(status, text)
        if verb == "metrics":
            return Response(200, CONTENT_TYPE, self.metrics.render())
        began = time.perf_counter()
        try:
            status, document, label = self.answer(verb, request.body)
        except Exception:
            log.exception("%s failed", verb)
            status, document, label = 500, {"error": f"{verb}: internal error"}, "internal"
        data = json.dumps(document, separators=(",", ":")).encode()
        self.metrics.observe(verb, label, time.perf_counter() - began)
        return Response(status, "application/json", data)

    def _handle_health(self, request: Request) -> Response:
        verb = self.route(request.method, request.target)
        if verb not in ("healthz", "metrics"):
            return _text(
                404 if verb is None or verb != "method" else 405,
                "this port serves GET /healthz and /metrics only; the verbs are on the "
                "HTTPS port\n",
            )
        return self._handle(request)


def _text(status: int, text: str) -> Response:
    return Response(status, "text/plain", text.encode())
