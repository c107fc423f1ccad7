"""What the extender knows of the cluster: every GPU node's cards and what is placed on them.

Fed by one LIST+WATCH of nodes and one of pods, each object turned into a small record
at once (50,000 pods cost a few tens of MiB); nothing is listed per request, and a
restart rebuilds everything from the API. A node's card loads come from:

1. its ``<label_prefix>gpus`` annotation, published by gpushare-node from its ledger,
   authoritative for the containers it lists;
2. the node's active pods whose GPU containers the annotation does not list yet,
   counted on the cards their believed placement names, else where the policy would
   put them (whole cards: the lowest-index idle ones, as the daemon gives them);
3. the assume cache: binds decided here that the pod watch has not shown bound yet.

``assume`` records a bind's placement in the same critical section that computed it,
before any request leaves, so no card's space is given twice. ``bound`` starts its
expiry (``assume_ttl_seconds``); ``forget`` drops it when the bind failed for sure. The
first watch event showing the pod bound drops it in the section that counts the pod
itself, so it is never counted twice or not at all; one never confirmed expires
(logged, counted).

A pod's placement is believed per the cache's ``trust``
(``nodemgr.domain.extenderchoice``); one not believed counts where the policy would put
it and is reported (``on_ignored``). An unreadable pod is left out and reported: one
pod never stops the LIST (the cache would stay unsynced, and GPU scheduling with it).

What it must not do: I/O (the watch threads and the server do it), or hold
the lock while iterating a LIST (``replace`` builds first, then swaps).

Longer than 400 lines: the caches and the assumed binds share one lock, changing together.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from nodemgr.domain.extenderchoice import PlacementTrust, show
from nodemgr.domain.placement import CardLoad, NoFitDescriber, choose_card
from nodemgr.domain.podmatch import FINISHED_PHASES, PodInfo, parse_extender_index
from nodemgr.errors import NoFitError
from nodemgr.extender.logic import (
    RESERVED_FOR_WHOLE,
    NodeView,
    Placement,
    PodDemand,
    Resources,
    pod_demand,
)
from nodemgr.kubernetes.podwatch import pod_info
from nodemgr.kubernetes.publish import NODE_ANNOTATION, parse_node_annotation

log = logging.getLogger("nodemgr.extender")

PodKey = tuple[str, str]  # (namespace, name)
Owner = tuple[str, str, str]  # (namespace, pod, container)
SEEN_PODS = 4096  # from filter calls, for a bind that comes before the watch
# Over all pods remembered (250,000: 50 pods in flight at once on 5,000 nodes).
PASSED_NAMES = 250_000


@dataclass(frozen=True, slots=True)
class CardRecord:
    index: int
    uuid: str
    model: str
    memory_mib: int
    memory_allocated_mib: int
    core_allocated_percent: int
    mode: str  # shared, whole, idle
    healthy: bool | None


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    cards: tuple[CardRecord, ...]
    annotated: frozenset[Owner]  # containers the annotation lists (authoritative for them)
    problem: str = ""  # non-empty: not a usable gpushare node, and why


@dataclass(frozen=True, slots=True)
class PodRecord:
    demand: PodDemand
    node: str  # "" while not bound
    active: bool  # bound and not finished: it holds (or will hold) its cards
    cards: Mapping[int, int]  # container index -> card index
    created_at: float


@dataclass(slots=True)
class Assumption:
    """A bind the extender decided, until the pod watch shows the pod bound."""

    demand: PodDemand
    node: str
    cards: Mapping[int, int]
    decided_at: float
    expires_at: float | None = None  # set once the Binding was created


class ClusterCache:
    """Nodes, GPU pods and assumed binds; every reader and writer holds ``lock``."""

    def __init__(
        self,
        resources: Resources,
        label_prefix: str,
        policy: str,
        assume_ttl_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        trust: PlacementTrust | None = None,
        on_ignored: Callable[[str, str, str, str], None] | None = None,
    ):
        self.resources = resources
        self.trust = trust or PlacementTrust(label_prefix=label_prefix)
        # (namespace, pod, uid, why): a pod's placement or the pod itself left out
        self.on_ignored = on_ignored or (lambda namespace, pod, uid, why: None)
        self.annotation_key = label_prefix + NODE_ANNOTATION
        self.policy = policy
        self.assume_ttl_seconds = assume_ttl_seconds
        self._clock = clock
        self.lock = threading.RLock()
        self._nodes: dict[str, NodeRecord] = {}
        self._pods: dict[PodKey, PodRecord] = {}
        self._uids: dict[str, PodKey] = {}
        self._on_node: dict[str, dict[PodKey, PodRecord]] = {}
        self._assumed: dict[str, Assumption] = {}  # pod UID -> assumption
        self._assumed_on: dict[str, set[str]] = {}  # node -> UIDs
        self._views: dict[str, NodeView] = {}
        self._seen: OrderedDict[str, PodDemand] = OrderedDict()
        self._passed: OrderedDict[str, frozenset[str]] = OrderedDict()  # pod UID -> nodes
        self._passed_names = 0
        self.nodes_synced = False
        self.pods_synced = False
        self.expired_total = 0
        self.confirmed_total = 0
        self.node_handler = _NodeHandler(self)
        self.pod_handler = _PodHandler(self)

    # --- readers (hold the lock) ---------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self.nodes_synced and self.pods_synced

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {
                "nodes": len(self._nodes),
                "gpu_nodes": sum(1 for n in self._nodes.values() if not n.problem),
                "pods": len(self._pods),
                "assumed": len(self._assumed),
            }

    def pod(self, namespace: str, name: str) -> PodRecord | None:
        return self._pods.get((namespace, name))

    def remember(self, demand: PodDemand, passed: Iterable[str] = ()) -> None:
        """Bind may come before the watch shows the pod, and binds only to ``passed``."""
        if not demand.uid:
            return
        with self.lock:
            self._seen[demand.uid] = demand
            self._seen.move_to_end(demand.uid)
            while len(self._seen) > SEEN_PODS:
                self._seen.popitem(last=False)
            old = self._passed.pop(demand.uid, None)
            self._passed_names -= len(old) if old is not None else 0
            nodes = self._nodes
            # The cache's own strings: one copy each.
            names = frozenset(n.name if (n := nodes.get(name)) else name for name in passed)
            self._passed[demand.uid] = names
            self._passed_names += len(names)
            while self._passed and (
                self._passed_names > PASSED_NAMES or len(self._passed) > SEEN_PODS
            ):
                _, dropped = self._passed.popitem(last=False)
                self._passed_names -= len(dropped)

    def passed_filter(self, uid: str, node: str) -> bool:
        names = self._passed.get(uid)
        return names is not None and node in names

    def demand_for_bind(self, namespace: str, name: str, uid: str) -> PodDemand | None:
        """From the watch, else from a filter call (by UID, which the bind must name)."""
        if not uid:
            return None
        record = self._pods.get((namespace, name))
        if record is not None and record.demand.uid == uid:
            return record.demand
        seen = self._seen.get(uid)
        if seen is not None and (seen.namespace, seen.name) == (namespace, name):
            return seen
        return None

    def view(self, name: str) -> NodeView:
        """Cached until something changes."""
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = self._compute(name)
        return view

    def is_assumed(self, uid: str) -> bool:
        return uid in self._assumed

    # --- the assume cache ---------------------------------------------------------------

    def assume(self, placement: Placement, demand: PodDemand) -> None:
        """Call in the critical section that computed it."""
        self._drop_assumption(demand.uid)
        self._assumed[demand.uid] = Assumption(
            demand, placement.node, dict(placement.cards), self._clock()
        )
        self._assumed_on.setdefault(placement.node, set()).add(demand.uid)
        self._views.pop(placement.node, None)

    def bound(self, uid: str) -> None:
        with self.lock:
            assumption = self._assumed.get(uid)
            if assumption is not None:
                assumption.expires_at = self._clock() + self.assume_ttl_seconds

    def forget(self, uid: str) -> None:
        with self.lock:
            self._drop_assumption(uid)

    def expire(self) -> int:
        now = self._clock()
        with self.lock:
            late = [
                uid
                for uid, a in self._assumed.items()
                if a.expires_at is not None and a.expires_at <= now
            ]
            for uid in late:
                a = self._assumed[uid]
                log.warning(
                    "assumed bind of %s to %s expired after %.0f s without the pod watch "
                    "showing it bound: its cards count as free again",
                    a.demand.label,
                    a.node,
                    self.assume_ttl_seconds,
                )
                self._drop_assumption(uid)
            self.expired_total += len(late)
            return len(late)

    def _drop_assumption(self, uid: str) -> Assumption | None:
        assumption = self._assumed.pop(uid, None)
        if assumption is not None:
            on = self._assumed_on.get(assumption.node)
            if on is not None:
                on.discard(uid)
                if not on:
                    del self._assumed_on[assumption.node]
            self._views.pop(assumption.node, None)
        return assumption

    # --- the watch handlers' updates (they hold the lock) --------------------------------

    def _put_node(self, record: NodeRecord) -> None:
        self._nodes[record.name] = record
        self._views.pop(record.name, None)

    def _drop_node(self, name: str) -> None:
        self._nodes.pop(name, None)
        self._views.pop(name, None)

    def _put_pod(self, key: PodKey, record: PodRecord | None, uid: str, bound_to: str) -> None:
        """``record`` None: gone or no GPU; an assumption of it is confirmed in one step."""
        old = self._pods.pop(key, None)
        if old is not None:
            self._uids.pop(old.demand.uid, None)
            if old.node:
                self._on_node.get(old.node, {}).pop(key, None)
                self._views.pop(old.node, None)
        if record is not None:
            self._pods[key] = record
            self._uids[record.demand.uid] = key
            if record.node:
                self._on_node.setdefault(record.node, {})[key] = record
                self._views.pop(record.node, None)
        if uid in self._assumed and (record is None or bound_to):
            self._drop_assumption(uid)
            self.confirmed_total += 1

    def _replace_nodes(self, records: dict[str, NodeRecord]) -> None:
        self._nodes = records
        self._views.clear()
        self.nodes_synced = True

    def _replace_pods(self, records: dict[PodKey, PodRecord]) -> None:
        self._pods = records
        self._uids = {r.demand.uid: key for key, r in records.items()}
        self._on_node = {}
        for key, record in records.items():
            if record.node:
                self._on_node.setdefault(record.node, {})[key] = record
        for uid in list(self._assumed):
            bound = self._uids.get(uid)
            if bound is not None and self._pods[bound].node:
                self._drop_assumption(uid)
                self.confirmed_total += 1
        self._views.clear()
        self.pods_synced = True

    # --- the node view --------------------------------------------------------------------

    def _compute(self, name: str) -> NodeView:
        node = self._nodes.get(name)
        if node is None:
            return NodeView(
                name,
                (),
                problem=f"{name} is not in the extender's node cache (the node watch has not "
                "seen it yet, or it was deleted)",
            )
        if node.problem:
            return NodeView(name, (), problem=node.problem)
        unit = self.resources.memory_unit_mib
        used_mib = {c.index: c.memory_allocated_mib for c in node.cards}
        used_core = {c.index: c.core_allocated_percent for c in node.cards}
        whole_pending = 0
        unplaced = []
        sources: list[tuple[PodDemand, Mapping[int, int]]] = [
            (r.demand, r.cards)
            for r in sorted(self._on_node.get(name, {}).values(), key=lambda r: r.created_at)
            if r.active
        ]
        sources += [
            (self._assumed[uid].demand, self._assumed[uid].cards)
            for uid in sorted(self._assumed_on.get(name, ()))
        ]
        for demand, cards in sources:
            for c in demand.containers:
                if (demand.namespace, demand.name, c.name) in node.annotated:
                    continue
                whole_pending += c.whole
                if not c.shared:
                    continue
                card = cards.get(c.index)
                if card is None or card not in used_mib:
                    unplaced.append(c)
                    continue
                used_mib[card] += c.memory_units * unit
                used_core[card] += c.core_percent
        loads = [
            CardLoad(
                index=c.index,
                uuid=c.uuid,
                name=c.model,
                memory_units_total=c.memory_mib // unit,
                memory_units_free=max(
                    c.memory_mib // unit - math.ceil(used_mib[c.index] / unit), 0
                ),
                core_percent_free=max(100 - used_core[c.index], 0),
                unavailable_reason="given out whole"
                if c.mode == "whole"
                else "unhealthy (see nodemgr status on the node)"
                if c.healthy is False
                else "",
            )
            for c in node.cards
        ]
        if unplaced:  # bound without a card choice: where the daemon's policy will put them
            describe = NoFitDescriber(name, unit)
            for c in unplaced:
                try:
                    chosen = choose_card(loads, c.request, self.policy, describe)
                except NoFitError:
                    continue  # the node will refuse it: it holds nothing
                at = loads.index(chosen)
                loads[at] = replace(
                    chosen,
                    memory_units_free=chosen.memory_units_free - c.memory_units,
                    core_percent_free=chosen.core_percent_free - c.core_percent,
                )
        idle = [
            load.index
            for load, card in zip(loads, node.cards, strict=True)
            if not load.unavailable_reason
            and load.memory_units_free == load.memory_units_total
            and load.core_percent_free == 100
            and card.mode == "idle"
        ]
        reserved = set(idle[:whole_pending])
        if reserved:
            loads = [
                replace(load, unavailable_reason=RESERVED_FOR_WHOLE)
                if load.index in reserved
                else load
                for load in loads
            ]
        return NodeView(name, tuple(loads), tuple(idle[whole_pending:]))


class _NodeHandler:
    def __init__(self, cache: ClusterCache):
        self._cache = cache

    def record(self, obj: Mapping[str, Any]) -> NodeRecord:
        metadata = obj.get("metadata") or {}
        name = str(metadata.get("name") or "")
        key = self._cache.annotation_key
        text = (metadata.get("annotations") or {}).get(key)
        if text is None:
            return NodeRecord(
                name,
                (),
                frozenset(),
                f"{name} has no {key} annotation: gpushare-node does not run there, or has "
                "not published its GPUs yet",
            )
        try:
            gpus = parse_node_annotation(text)
        except ValueError as e:
            return NodeRecord(name, (), frozenset(), f"{name}: unreadable {key} annotation: {e}")
        cards = []
        owners: set[Owner] = set()
        for gpu in gpus:
            cards.append(
                CardRecord(
                    index=gpu["index"],
                    uuid=str(gpu.get("uuid") or ""),
                    model=str(gpu.get("model") or ""),
                    memory_mib=gpu["memory_mib"],
                    memory_allocated_mib=gpu["memory_allocated_mib"],
                    core_allocated_percent=int(gpu.get("core_allocated_percent") or 0),
                    mode=str(gpu.get("mode") or "idle"),
                    healthy=gpu.get("healthy"),
                )
            )
            for entry in gpu.get("allocations") or ():
                if isinstance(entry, list) and len(entry) >= 3 and entry[1]:
                    owners.add((str(entry[0]), str(entry[1]), str(entry[2])))
        if not cards:
            return NodeRecord(name, (), frozenset(), f"{name}: gpushare-node there has no GPUs")
        return NodeRecord(name, tuple(cards), frozenset(owners))

    def _safe_record(self, obj: Mapping[str, Any]) -> NodeRecord:
        """An unreadable node takes no GPU pod (and says why): it never stops the LIST."""
        try:
            return self.record(obj)
        except Exception as e:
            metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
            name = str((metadata or {}).get("name") or "") if isinstance(metadata, Mapping) else ""
            why = f"{name}: unreadable node ({type(e).__name__}: {show(str(e))})"
            log.warning("node %s left without GPUs in the cache: %s", show(name), why)
            return NodeRecord(name, (), frozenset(), why)

    def replace(self, items: Iterator[Mapping[str, Any]]) -> None:
        records = {}
        for obj in items:
            record = self._safe_record(obj)
            records[record.name] = record
        with self._cache.lock:
            self._cache._replace_nodes(records)

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        record = self._safe_record(obj)
        with self._cache.lock:
            if kind == "DELETED":
                self._cache._drop_node(record.name)
            else:
                self._cache._put_node(record)


class _PodHandler:
    """Pods asking no GPU are not kept."""

    def __init__(self, cache: ClusterCache):
        self._cache = cache
        self._notes: dict[str, str] = {}  # pod UID -> the reason last reported

    def record(self, obj: Mapping[str, Any]) -> tuple[PodKey, PodRecord | None, str, str]:
        info = pod_info(obj, self._cache.trust)
        key = (info.namespace, info.name)
        self._report(info)
        demand = pod_demand(info, self._cache.resources)
        if not demand.wants_gpu:
            return key, None, info.uid, info.node_name
        cards = {}
        for c in demand.containers:
            if c.shared:
                index = parse_extender_index(info, c.index)
                if index is not None:
                    cards[c.index] = index
        active = bool(info.node_name) and info.phase not in FINISHED_PHASES
        record = PodRecord(demand, info.node_name, active, cards, info.created_at)
        return key, record, info.uid, info.node_name

    def _report(self, info: PodInfo) -> None:
        if not info.choice_note:
            self._notes.pop(info.uid, None)
            return
        if self._notes.get(info.uid) != info.choice_note:
            if len(self._notes) >= SEEN_PODS:
                self._notes.pop(next(iter(self._notes)))
            self._notes[info.uid] = info.choice_note
            self._cache.on_ignored(info.namespace, info.name, info.uid, info.choice_note)

    def _safe_record(
        self, obj: Mapping[str, Any]
    ) -> tuple[PodKey, PodRecord | None, str, str] | None:
        try:
            return self.record(obj)
        except Exception as e:  # one pod must never stop the LIST or the watch
            metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
            metadata = metadata if isinstance(metadata, Mapping) else {}
            namespace, name, uid = (
                str(metadata.get(k) or "") for k in ("namespace", "name", "uid")
            )
            why = f"gpushare-scheduler cannot read this pod ({type(e).__name__}: {show(str(e))})"
            log.warning("pod %s/%s left out of the cache: %s", show(namespace), show(name), why)
            self._cache.on_ignored(namespace, name, uid, why + ": left out of its GPU accounting")
            return None

    def replace(self, items: Iterator[Mapping[str, Any]]) -> None:
        records = {}
        for obj in items:
            read = self._safe_record(obj)
            if read is not None and read[1] is not None:
                records[read[0]] = read[1]
        with self._cache.lock:
            self._cache._replace_pods(records)

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        read = self._safe_record(obj)
        if read is None:
            return
        key, record, uid, node = read
        with self._cache.lock:
            if kind == "DELETED":
                self._notes.pop(uid, None)
                self._cache._put_pod(key, None, uid, node)
            else:
                self._cache._put_pod(key, record, uid, node)
