"""The Kubernetes adapter: a cache of this node's pods in, annotations, labels and events out.

Two daemon threads:

- the pod watch (nodemgr.kubernetes.podwatch): the pods bound to this node, cached for
  the Allocate path;
- the writer (here): pod annotations, node labels and annotations,
  ``aliyun.com/gpu-count`` in node status, pod Events. Callers only queue the desired
  state, coalesced with a pending one; failures retry with exponential backoff while
  the API server is down, slow or says 5xx/429; a write is dropped with a log line on
  404 or 403.

What it must not do: block or do I/O in the calls the Allocate path makes
(``pods``, ``generation``, ``wait_for_change``, ``patch_pod_annotations``),
raise out of ``start`` because the API server or the credentials are
missing (the daemon then runs as a plain device plugin), touch node labels
outside ``kubernetes.label_prefix``, or use the kubernetes client's global
default configuration.

Longer than 400 lines: the facade, write queue and writer thread share one lock and mode.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nodemgr.config.schema import KubernetesSettings
from nodemgr.domain.podmatch import PodInfo
from nodemgr.errors import (
    KubeApiError,
    KubeConflict,
    KubeCredentialsError,
    KubeForbidden,
    KubeNotFound,
    KubeUnavailable,
)
from nodemgr.kubernetes.client import (
    SERVICE_ACCOUNT_DIR,
    ApiSession,
    Credentials,
    find_credentials,
    new_api_client,
    rfc3339,
)
from nodemgr.kubernetes.podwatch import PodWatch, placement_trust
from nodemgr.kubernetes.writes import Backoff, EventLimiter, WriteQueue, merge_keys, replace

log = logging.getLogger(__name__)

# (API group, resource, verbs): every request the adapter makes. deploy/'s
# ClusterRole must grant exactly these (a test compares them).
API_PERMISSIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("", "pods", ("get", "list", "watch", "patch")),
    ("", "nodes", ("get", "patch")),
    ("", "nodes/status", ("patch",)),
    ("", "events", ("create", "patch")),
)

EVENT_COMPONENT = "gpushare-node"
PLACEMENT_IGNORED_REASON = "GPUSharePlacementIgnored"
MERGE_PATCH = "application/merge-patch+json"
# Repeats patch the posted Event (count, lastTimestamp), as kubelet's recorder does,
# while younger than this: the API server deletes events after an hour by default.
EVENT_REUSE_SECONDS = 50 * 60.0
_LABEL_PART = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


@dataclass
class _PostedEvent:
    name: str
    count: int
    first_at: float  # adapter clock
    type: str


def _merge_event(older: dict, newer: dict) -> dict:
    """Occurrences that waited in the queue add up; the latest message is shown."""
    return {**newer, "count": older["count"] + newer["count"], "first_at": older["first_at"]}


_MERGES: dict[str, Callable[[Any, Any], Any]] = {
    "pod-annotations": merge_keys,
    "node-labels": replace,
    "node-annotations": merge_keys,
    "node-resources": merge_keys,
    "event": _merge_event,
}


class KubeAdapter:
    def __init__(
        self,
        settings: KubernetesSettings,
        node_name: str,
        clock: Callable[[], float] = time.time,
        *,
        environ: Mapping[str, str] | None = None,
        home: str | None = None,
        service_account_dir: str = SERVICE_ACCOUNT_DIR,
        watch_timeout_seconds: int = 300,
        initial_backoff_seconds: float = 0.5,
        max_backoff_seconds: float = 30.0,
        event_interval_seconds: float = 60.0,
        events_per_second: float = 5.0,
        candidate_filter: Callable[[PodInfo], bool] | None = None,
    ):
        self.settings = settings
        self._candidate_filter = candidate_filter
        self.node_name = node_name
        self._clock = clock  # event timestamps and rate limit
        self._environ = environ
        self._home = home
        self._service_account_dir = service_account_dir
        self._watch_timeout_seconds = watch_timeout_seconds
        self._backoff_seconds = (initial_backoff_seconds, max_backoff_seconds)

        # Writes, rate limit and mode; never held over I/O.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: WriteQueue[tuple[Any, ...]] = WriteQueue(
            time.monotonic, initial_backoff_seconds, max_backoff_seconds
        )
        self._limiter = EventLimiter(
            clock,
            per_key_interval_seconds=event_interval_seconds,
            rate_per_second=events_per_second,
        )
        self._mode = "new"  # new (queueing), running, off
        self._start_error: str | None = None

        self.name = "kubernetes-adapter"
        self._stop = threading.Event()
        self._credentials: Credentials | None = None
        self._session: ApiSession | None = None
        self._watch: PodWatch | None = None
        self._writer: threading.Thread | None = None
        self._events: dict[tuple, _PostedEvent] = {}  # the writer thread's only
        # add_writer's kinds (nodemgr.kubernetes.dra): kind -> (merge, write).
        self._merges: dict[str, Callable[[Any, Any], Any]] = dict(_MERGES)
        self._writers: dict[str, Callable[[ApiSession, tuple, Any], None]] = {}

    # --- life cycle ------------------------------------------------------

    def start(self) -> None:
        """Without credentials, log why and do nothing."""
        with self._lock:
            if self._mode != "new":
                return
        if not self.settings.enabled:
            log.info("kubernetes.enabled is false: no pod identity, annotations, labels or events")
            self._go_off()
            return
        try:
            credentials = find_credentials(
                self.settings.kubeconfig, self._environ, self._home, self._service_account_dir
            )
            api_client = new_api_client(credentials, self._environ)
        except KubeCredentialsError as e:
            log.warning("Kubernetes API not used, running as a plain device plugin: %s", e)
            self._start_error = str(e)
            self._go_off()
            return
        self._credentials = credentials
        self._session = ApiSession(
            api_client, self.settings.request_timeout_seconds, self._clock, self._reconnected
        )
        self._watch = PodWatch(
            self._session,
            self.node_name,
            self._stop,
            self._watch_timeout_seconds,
            Backoff(*self._backoff_seconds),
            self._candidate_filter,
            trust=placement_trust(self.settings),
            on_ignored=self._placement_ignored,
        )
        self._writer = threading.Thread(target=self._write_loop, name="kube-writer", daemon=True)
        log.info(
            "Kubernetes API server %s, credentials from %s",
            self._session.host,
            credentials.describe(),
        )
        with self._lock:
            self._mode = "running"
        self._watch.thread.start()
        self._writer.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._mode = "off"
            self._wake.notify_all()
        if self._watch is not None:
            self._watch.abort()

    def join(self, timeout_seconds: float) -> bool:
        """A request stuck on a hung API server is abandoned: it ends at its own timeout and
        changes nothing after the stop."""
        if self._watch is None or self._writer is None or self._session is None:
            return True
        deadline = time.monotonic() + timeout_seconds
        threads = (self._watch.thread, self._writer)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            return False
        self._session.close()
        return True

    @property
    def alive(self) -> bool:
        """Not stopped, and its threads up when it has any."""
        if self._stop.is_set():
            return False
        if self._watch is None:
            return True
        return (
            self._watch.thread.is_alive() and self._writer is not None and self._writer.is_alive()
        )

    def _placement_ignored(self, pod: PodInfo) -> None:
        log.warning("pod %s/%s: %s", pod.namespace, pod.name, pod.choice_note)
        self.record_event(pod.namespace, pod.name, PLACEMENT_IGNORED_REASON, pod.choice_note)

    def _go_off(self) -> None:
        with self._lock:
            self._mode = "off"
            self._queue.clear()

    # --- the pod cache (no I/O, no lock held over I/O) -------------------

    def pods(self) -> list[PodInfo]:
        return [] if self._watch is None else list(self._watch.pods())

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return None if self._watch is None else self._watch.pod(namespace, name)

    def candidates(self) -> tuple[PodInfo, ...]:
        """Kept per event: no walk of the cache."""
        return () if self._watch is None else self._watch.candidates()

    def candidates_asking(self, resource: str, size: int) -> tuple[PodInfo, ...]:
        """An index kept per event; none without a watch."""
        return () if self._watch is None else self._watch.candidates_asking(resource, size)

    @property
    def generation(self) -> int:
        return 0 if self._watch is None else self._watch.generation

    @property
    def synced(self) -> bool:
        """The cache holds a complete LIST (and the watch events after it)."""
        return self._watch is not None and self._watch.synced

    def wait_for_change(self, seen_generation: int, timeout: float) -> int:
        watch = self._watch
        if watch is None:  # disabled or no credentials: nothing will ever change
            self._stop.wait(timeout)
            return 0
        return watch.wait_for_change(seen_generation, timeout)

    # --- writes: queued, never blocking ----------------------------------

    def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> None:
        """None removes; merged with a pending patch of that pod."""
        self._put(("pod-annotations", namespace, name), dict(annotations))

    def set_node_labels(self, desired: Mapping[str, str]) -> None:
        """Make the node's labels under the prefix exactly ``desired`` (names without it)."""
        valid = {}
        for name, value in desired.items():
            if name and _LABEL_PART.fullmatch(name) and _LABEL_PART.fullmatch(value):
                valid[name] = value
            else:
                log.warning(
                    "node label %s%s=%r not written: name and value must be at most 63 of "
                    "[A-Za-z0-9-_.], alphanumeric at both ends",
                    self.settings.label_prefix,
                    name,
                    value,
                )
        self._put(("node-labels",), valid)

    def set_node_annotations(self, annotations: Mapping[str, str | None]) -> None:
        self._put(("node-annotations",), dict(annotations))

    def set_node_extended_resources(self, quantities: Mapping[str, int | None]) -> None:
        """In the node's status capacity and allocatable (None removes)."""
        self._put(("node-resources",), dict(quantities))

    def add_writer(
        self,
        kind: str,
        write: Callable[[ApiSession, tuple, Any], None],
        merge: Callable[[Any, Any], Any] = replace,
    ) -> None:
        """A kind of write for ``queue_write``, done by ``write(session, key, value)`` in the
        writer thread (register before ``start``); unavailable and conflict errors are
        retried with backoff, others dropped."""
        self._merges[kind] = merge
        self._writers[kind] = write

    def queue_write(self, key: tuple, value: Any) -> None:
        """``key[0]``: the kind; a newer value coalesces with a pending one."""
        self._put(key, value)

    def read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """GET a ResourceClaim now (the DRA prepare path may wait for it)."""
        session = self._session
        if session is None:
            raise KubeUnavailable(
                f"no Kubernetes API ({self._start_error or 'the adapter is not running'})"
            )
        result: dict[str, Any] = session.call(
            "get",
            f"resourceclaims/{namespace}/{name}",
            session.resource.read_namespaced_resource_claim,
            name,
            namespace,
        )
        return result

    def record_event(
        self, namespace: str, pod: str, reason: str, message: str, type: str = "Warning"
    ) -> None:
        """Subject to the rate limit (suppressed ones are counted)."""
        with self._lock:
            if self._mode == "off":
                return
            count = self._limiter.admit((namespace, pod, reason))
            if count is None:
                return
            value = {"message": message, "type": type, "count": count, "first_at": self._clock()}
            self._queue.put(("event", namespace, pod, reason), value, _merge_event)
            self._wake.notify()

    def _put(self, key: tuple, value: Any) -> None:
        with self._lock:
            if self._mode == "off":
                return
            self._queue.put(key, value, self._merges[key[0]])
            self._wake.notify()

    def state(self) -> dict:
        session, watch = self._session, self._watch
        with self._lock:
            pending = len(self._queue)
            active = self._mode == "running"
        return {
            "enabled": self.settings.enabled,
            "active": active,  # threads running (enabled, credentials found, not stopped)
            "connected": session is not None and session.connected,
            "watching": watch is not None and watch.watching,
            "synced": self.synced,
            "pods": len(self.pods()),
            "pending_writes": pending,
            "last_error": self._start_error if session is None else session.last_error,
            "last_error_at": None if session is None else session.last_error_at,
            "credentials": None if self._credentials is None else self._credentials.describe(),
            "api_server": None if session is None else session.host,
        }

    def _reconnected(self) -> None:
        """Whatever waits out a backoff goes now."""
        with self._lock:
            self._queue.reset_backoff()
            self._wake.notify_all()

    # --- the writer thread -----------------------------------------------

    @property
    def _api(self) -> ApiSession:
        assert self._session is not None
        return self._session

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                if self._mode != "running":
                    return
                item = self._queue.take()
                if item is None:
                    wait_seconds = self._queue.seconds_until_due()
                    self._wake.wait(5.0 if wait_seconds is None else min(wait_seconds, 5.0))
                    continue
            key, value = item
            self._write(key, value)

    def _write(self, key: tuple, value: Any) -> None:
        kind = key[0]
        try:
            if kind == "pod-annotations":
                self._write_pod_annotations(key[1], key[2], value)
            elif kind == "node-labels":
                self._write_node_labels(value)
            elif kind == "node-annotations":
                self._patch_node({"metadata": {"annotations": value}})
            elif kind == "node-resources":
                self._write_node_resources(value)
            elif kind in self._writers:
                self._writers[kind](self._api, key, value)
            else:
                self._write_event(key[1], key[2], key[3], value)
        except (KubeUnavailable, KubeConflict) as e:
            self._retry(key, value, e)
            return
        except KubeNotFound as e:
            if kind.startswith("node-"):
                # The Node object appears when kubelet registers: wait for it.
                self._api.log_once(f"node {self.node_name} not found (yet?): {e}", logging.WARNING)
                self._retry(key, value, e)
                return
            log.info("dropped a write for %s/%s, it is gone: %s", key[1], key[2], e)
        except KubeForbidden:
            pass  # the session logged it once, with the RBAC it lacks
        except KubeApiError as e:
            log.warning("dropped a write the API server refused: %s", e)
        except Exception:
            log.exception("dropped a write to the Kubernetes API (%s)", kind)
        with self._lock:
            self._queue.done(key)

    def _retry(self, key: tuple, value: Any, error: KubeApiError) -> None:
        with self._lock:
            delay = self._queue.retry(key, value, self._merges[key[0]], str(error))
        log.debug("write %s failed, again in %.1f s: %s", key, delay, error)

    def _write_pod_annotations(self, namespace: str, name: str, annotations: dict) -> None:
        cached = self.pod(namespace, name)
        if cached is not None and all(
            cached.annotations.get(k) == v for k, v in annotations.items()
        ):
            return  # the pod already shows them
        self._api.call(
            "patch",
            f"pods/{namespace}/{name}",
            self._api.core.patch_namespaced_pod,
            name,
            namespace,
            {"metadata": {"annotations": annotations}},
            _content_type=MERGE_PATCH,
        )

    def _write_node_labels(self, desired: dict[str, str]) -> None:
        # Read first: the labels under our prefix that are no longer desired
        # are removed, and only those; anything else on the node is not ours.
        node = self._api.call(
            "get", f"nodes/{self.node_name}", self._api.core.read_node, self.node_name
        )
        current = (node.get("metadata") or {}).get("labels") or {}
        prefix = self.settings.label_prefix
        patch: dict[str, str | None] = {
            key: None
            for key in current
            if key.startswith(prefix) and key[len(prefix) :] not in desired
        }
        for name, value in desired.items():
            if current.get(prefix + name) != value:
                patch[prefix + name] = value
        if patch:
            self._patch_node({"metadata": {"labels": patch}})

    def _patch_node(self, body: dict) -> None:
        self._api.call(
            "patch",
            f"nodes/{self.node_name}",
            self._api.core.patch_node,
            self.node_name,
            body,
            _content_type=MERGE_PATCH,
        )

    def _write_node_resources(self, quantities: dict[str, int | None]) -> None:
        values = {name: None if q is None else str(q) for name, q in quantities.items()}
        self._api.call(
            "patch",
            f"nodes/status/{self.node_name}",
            self._api.core.patch_node_status,
            self.node_name,
            {"status": {"capacity": values, "allocatable": values}},
            _content_type=MERGE_PATCH,
        )

    def _write_event(self, namespace: str, pod: str, reason: str, value: dict) -> None:
        key = (namespace, pod, reason)
        now = self._clock()
        for stale in [
            k for k, p in self._events.items() if now - p.first_at >= EVENT_REUSE_SECONDS
        ]:
            del self._events[stale]
        posted = self._events.get(key)
        if posted is not None and posted.type == value["type"]:
            try:
                self._api.call(
                    "patch",
                    f"events/{namespace}/{posted.name}",
                    self._api.core.patch_namespaced_event,
                    posted.name,
                    namespace,
                    {
                        "count": posted.count + value["count"],
                        "message": value["message"],
                        "lastTimestamp": rfc3339(now),
                    },
                    _content_type=MERGE_PATCH,
                )
                posted.count += value["count"]
                return
            except KubeNotFound:
                del self._events[key]  # deleted or expired: post a new one
        involved = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod}
        cached = self.pod(namespace, pod)
        if cached is not None and cached.uid:
            involved["uid"] = cached.uid  # kubectl describe pod matches events by it
        # Unique per attempt (as kubelet: <pod>.<hex ns>); 253 is the name limit.
        name = f"{pod[:230]}.{time.time_ns():x}"
        self._api.call(
            "create",
            f"events/{namespace}",
            self._api.core.create_namespaced_event,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": namespace},
                "involvedObject": involved,
                "reason": reason,
                "message": value["message"],
                "type": value["type"],
                "count": value["count"],
                "firstTimestamp": rfc3339(value["first_at"]),
                "lastTimestamp": rfc3339(now),
                "source": {"component": EVENT_COMPONENT, "host": self.node_name},
                "reportingComponent": EVENT_COMPONENT,
                "reportingInstance": self.node_name,
            },
        )
        self._events[key] = _PostedEvent(name, value["count"], value["first_at"], value["type"])
