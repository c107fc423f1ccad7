"""The Kubernetes adapter's pod watch: the pods bound to this node, in a local cache.

Kept by a listwatch follower with ``spec.nodeName=<node>``. The cache is an immutable
snapshot replaced whole on each change, so the Allocate path reads it without a lock.
Two indexes are updated per event: the candidates (pods the allocator may match) and
``(resource, size) -> candidates`` asking exactly that, so an Allocate reads only the
pods that can match it. A pod whose placement annotation is not believed is reported
once per change of the reason (``on_ignored``) and stays in the cache without it.

What it must not do: list pods more than once per (re)start or expiry,
hold a lock over I/O, or let an error end the thread before ``stop``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from nodemgr.common.changes import ChangeCounter
from nodemgr.common.placementkey import PlacementKeyError, read_public_key
from nodemgr.config.schema import KubernetesSettings
from nodemgr.domain.extenderchoice import PlacementTrust, decide
from nodemgr.domain.podmatch import ContainerRequest, PodInfo, asked_sizes
from nodemgr.kubernetes.client import ApiSession
from nodemgr.kubernetes.kubeclient import parse_quantity
from nodemgr.kubernetes.listwatch import ListWatch
from nodemgr.kubernetes.writes import Backoff

log = logging.getLogger("nodemgr.kubernetes.adapter")

PodKey = tuple[str, str]  # (namespace, name)
Ask = tuple[str, int]  # (resource name, size)
# A bucket's order means nothing (find_demand orders); copied on write.
AskIndex = dict[Ask, dict[PodKey, PodInfo]]


class PodWatch:
    def __init__(
        self,
        session: ApiSession,
        node_name: str,
        stop: threading.Event,
        watch_timeout_seconds: int = 300,
        backoff: Backoff | None = None,
        candidate: Callable[[PodInfo], bool] | None = None,
        trust: PlacementTrust | None = None,
        on_ignored: Callable[[PodInfo], None] | None = None,
    ):
        self._trust = trust or PlacementTrust()
        self._on_ignored = on_ignored or (lambda pod: None)
        # Pending pods asking for a shared GPU, updated per event.
        self._candidate = candidate or (lambda pod: True)
        self._candidates: tuple[PodInfo, ...] = ()
        self._candidate_keys: dict[PodKey, PodInfo] = {}
        self._asking: AskIndex = {}
        self._node_name = node_name
        self._stop = stop
        self._cache: tuple[dict[PodKey, PodInfo], tuple[PodInfo, ...]] = ({}, ())
        self._synced = False
        self._cache_lock = threading.Lock()  # held only to publish, never over I/O
        self.changes = ChangeCounter()
        self._follower = ListWatch(
            session,
            "pods",
            self,
            stop,
            watch_timeout_seconds=watch_timeout_seconds,
            backoff=backoff,
            field_selector=f"spec.nodeName={node_name}",
            on_expired=self._unsync,
            name="pod watch",
            thread_name="kube-watch",
            logger=log,
        )
        self.thread = self._follower.thread

    # --- readers: no I/O, no lock but a short one to wait -------------------

    def pods(self) -> tuple[PodInfo, ...]:
        return self._cache[1]

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return self._cache[0].get((namespace, name))

    def candidates(self) -> tuple[PodInfo, ...]:
        """All pods without a filter."""
        return self._candidates

    def candidates_asking(self, resource: str, size: int) -> tuple[PodInfo, ...]:
        bucket = self._asking.get((resource, size))
        return tuple(bucket.values()) if bucket else ()

    @property
    def generation(self) -> int:
        return self.changes.generation

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def watching(self) -> bool:
        return self._follower.watching

    def wait_for_change(self, seen_generation: int, timeout: float) -> int:
        return self.changes.wait_for_change(seen_generation, timeout)

    def abort(self) -> None:
        """After ``stop`` is set."""
        self._follower.abort()

    # --- the follower's handler (the watch thread) ----------------------------

    def replace(self, items: Iterator[Mapping[str, Any]]) -> None:
        pods = {}
        old = self._cache[0]
        for item in items:
            info = pod_info(item, self._trust)
            key = (info.namespace, info.name)
            pods[key] = info
            self._report(old.get(key), info)
        candidates = {key: pod for key, pod in pods.items() if self._candidate(pod)}
        self._publish(pods, synced=True, index=(candidates, _ask_index(candidates.values())))

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        """A pod moved to another node is gone."""
        info = pod_info(obj, self._trust)
        key = (info.namespace, info.name)
        self._report(self._cache[0].get(key), info)
        pods = dict(self._cache[0])  # copy on write: readers keep their snapshot
        gone = kind == "DELETED" or (info.node_name and info.node_name != self._node_name)
        if gone:
            pods.pop(key, None)
        else:
            pods[key] = info
        old = self._candidate_keys.get(key)
        new = None if gone or not self._candidate(info) else info
        if old is None and new is None:
            self._publish(pods)  # neither was nor is a candidate: the indexes stay
            return
        candidates = dict(self._candidate_keys)  # small: the pending GPU pods only
        if new is None:
            del candidates[key]
        else:
            candidates[key] = new
        self._publish(pods, index=(candidates, _reindexed(self._asking, key, old, new)))

    def _report(self, old: PodInfo | None, new: PodInfo) -> None:
        if new.choice_note and (old is None or old.choice_note != new.choice_note):
            self._on_ignored(new)

    def _unsync(self) -> None:
        with self._cache_lock:
            self._synced = False

    def _publish(
        self,
        pods: dict[PodKey, PodInfo],
        synced: bool | None = None,
        index: tuple[dict[PodKey, PodInfo], AskIndex] | None = None,
    ) -> None:
        """``index`` None: the candidates and their ask index are kept."""
        if self._stop.is_set():
            return  # nothing changes after stop
        with self._cache_lock:
            self._cache = (pods, tuple(pods.values()))
            if index is not None:
                self._candidate_keys, self._asking = index
                self._candidates = tuple(index[0].values())
            if synced is not None:
                self._synced = synced
        self.changes.bump()


# --- the ask index ---------------------------------------------------------------


def _ask_index(candidates: Iterable[PodInfo]) -> AskIndex:
    buckets: AskIndex = {}
    for pod in candidates:
        for ask in asked_sizes(pod):
            buckets.setdefault(ask, {})[(pod.namespace, pod.name)] = pod
    return buckets


def _reindexed(index: AskIndex, key: PodKey, old: PodInfo | None, new: PodInfo | None) -> AskIndex:
    """A copy with pod ``key`` as ``new`` (None: not a candidate); only the buckets of what
    either asks are rebuilt."""
    old_asks = asked_sizes(old) if old is not None else frozenset()
    new_asks = asked_sizes(new) if new is not None else frozenset()
    if not old_asks and not new_asks:
        return index
    index = dict(index)  # small: one entry per distinct (resource, size) pending
    for ask in old_asks | new_asks:
        bucket = dict(index.get(ask, {}))  # a copy: readers keep theirs
        bucket.pop(key, None)
        if new is not None and ask in new_asks:
            bucket[key] = new  # a MODIFIED pod's fresh info, never the stale one
        if bucket:
            index[ask] = bucket
        else:
            index.pop(ask, None)
    return index


# --- pods from the API -------------------------------------------------------


def placement_trust(settings: KubernetesSettings) -> PlacementTrust:
    """An unreadable key is logged and trusts no signature."""
    path = settings.placement_public_key
    verifier, problem = None, "no kubernetes.placement_public_key is configured"
    if path:
        try:
            verifier, problem = read_public_key(path), ""
        except (OSError, PlacementKeyError) as e:
            problem = f"kubernetes.placement_public_key {path} is unusable: {e}"
            log.error("%s; no placement signature can be checked", problem)
    return PlacementTrust(settings.placement_trust, settings.label_prefix, verifier, problem)


def pod_info(pod: Any, trust: PlacementTrust | None = None) -> PodInfo:
    """A raw JSON dict or a ``V1Pod``; ``trust`` None: the extender's choice is not read."""
    data = pod if isinstance(pod, Mapping) else pod.to_dict(serialize=True)
    metadata = data.get("metadata") or {}
    spec = data.get("spec") or {}
    status = data.get("status") or {}
    annotations = {
        str(k): v for k, v in (metadata.get("annotations") or {}).items() if isinstance(v, str)
    }
    uid = metadata.get("uid") or ""
    node_name = spec.get("nodeName") or ""
    phase = status.get("phase") or "Pending"  # no status yet: just created
    choice, note = (
        decide(annotations, uid, node_name, phase == "Pending", trust)
        if trust is not None
        else (None, "")
    )
    return PodInfo(
        namespace=metadata.get("namespace") or "",
        name=metadata.get("name") or "",
        uid=uid,
        node_name=node_name,
        phase=phase,
        created_at=_unix_seconds(metadata.get("creationTimestamp")),
        deleting=metadata.get("deletionTimestamp") is not None,
        annotations=annotations,
        containers=tuple(_container(c) for c in spec.get("containers") or ()),
        init_containers=tuple(_container(c) for c in spec.get("initContainers") or ()),
        resource_version=metadata.get("resourceVersion") or "",
        choice=choice,
        choice_note=note,
    )


def is_extended_resource(name: str) -> bool:
    """A resource named ``<domain>/<name>`` outside kubernetes.io (device plugin resources)."""
    domain, slash, _ = name.partition("/")
    if not slash or name.startswith("requests."):
        return False
    return not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io"))


def extended_requests(resources: Mapping[str, Any] | None) -> dict[str, int]:
    """Integer requests of the extended resources; a limit alone counts as the request
    (the API server copies it, but a pod seen before defaulting may lack it)."""
    resources = resources or {}
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    result = {}
    for name in {*limits, *requests}:
        if not is_extended_resource(name):
            continue
        value = _integer_quantity(requests.get(name, limits.get(name)))
        if value is not None:
            result[name] = value
    return result


def _container(container: Mapping[str, Any]) -> ContainerRequest:
    return ContainerRequest(
        name=container.get("name") or "",
        requests=extended_requests(container.get("resources")),
    )


def _integer_quantity(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        quantity = value if isinstance(value, Decimal) else parse_quantity(str(value))
    except (ValueError, InvalidOperation):
        return None
    if quantity != quantity.to_integral_value():
        return None
    return int(quantity)


def _unix_seconds(timestamp: Any) -> float:
    """0.0 when missing."""
    if isinstance(timestamp, datetime):
        moment = timestamp
    elif isinstance(timestamp, str) and timestamp:
        try:
            moment = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
        except ValueError:
            return 0.0
    else:
        return 0.0
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)  # the API speaks UTC
    return moment.timestamp()
