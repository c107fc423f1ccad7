"""The Kubernetes adapter's pod watch: the pods bound to this node, in a local cache.

Part of the adapter (nodemgr.kubernetes.adapter, client, podwatch, writes).
One thread: a LIST of the pods with ``spec.nodeName=<node>``, then a WATCH
from the list's resourceVersion (bookmarks keep it fresh); a new WATCH from
the last version seen when the server ends one (every
``watch_timeout_seconds``) or the connection fails (with backoff); a new
LIST when the server says the version expired (410).

The cache is an immutable snapshot replaced whole on each change, so
readers (the Allocate path) take it without a lock and never wait on I/O.
``pod_info`` turns a pod of the API into the ``PodInfo`` the admission
match reads.

What it must not do: list pods more than once per (re)start or expiry,
hold a lock over I/O, or let an error end the thread before ``stop``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from nodemgr.common.changes import ChangeCounter
from nodemgr.domain.podmatch import ContainerRequest, PodInfo
from nodemgr.errors import KubeApiError, KubeExpired, KubeForbidden, KubeUnavailable
from nodemgr.kubernetes.client import ApiSession, map_error, status_error
from nodemgr.kubernetes.writes import Backoff

log = logging.getLogger("nodemgr.kubernetes.adapter")

PodKey = tuple[str, str]  # (namespace, name)


class PodWatch:
    """The cache of this node's pods and the thread that keeps it current."""

    def __init__(
        self,
        session: ApiSession,
        node_name: str,
        stop: threading.Event,
        watch_timeout_seconds: int = 300,
        backoff: Backoff | None = None,
        candidate: Callable[[PodInfo], bool] | None = None,
    ):
        self._session = session
        # Which pods the allocator may match (pending, asking for a shared GPU), kept as
        # an index updated per event: Allocate reads it without walking the whole cache.
        self._candidate = candidate or (lambda pod: True)
        self._candidates: tuple[PodInfo, ...] = ()
        self._candidate_keys: dict[PodKey, PodInfo] = {}
        self._node_name = node_name
        self._selector = f"spec.nodeName={node_name}"
        self._stop = stop
        self._watch_timeout_seconds = watch_timeout_seconds
        self._backoff = backoff or Backoff()
        self._cache: tuple[dict[PodKey, PodInfo], tuple[PodInfo, ...]] = ({}, ())
        self._synced = False
        self._cache_lock = threading.Lock()  # held only to publish, never over I/O
        self.changes = ChangeCounter()  # moves on every change of the cache
        self._response_lock = threading.Lock()
        self._response: Any = None  # the open watch stream, for abort()
        self.watching = False
        self.thread = threading.Thread(target=self._run, name="kube-watch", daemon=True)

    # --- readers: no I/O, no lock but a short one to wait -------------------

    def pods(self) -> tuple[PodInfo, ...]:
        return self._cache[1]

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return self._cache[0].get((namespace, name))

    def candidates(self) -> tuple[PodInfo, ...]:
        """The cached pods the candidate filter accepts (all pods without a filter)."""
        return self._candidates

    @property
    def generation(self) -> int:
        return self.changes.generation

    @property
    def synced(self) -> bool:
        return self._synced

    def wait_for_change(self, seen_generation: int, timeout: float) -> int:
        return self.changes.wait_for_change(seen_generation, timeout)

    def abort(self) -> None:
        """After ``stop`` is set: end a blocked read of the watch stream now."""
        with self._response_lock:
            response = self._response
        if response is not None:
            _wake_reader(response)  # the watch thread closes it

    def _publish(
        self,
        pods: dict[PodKey, PodInfo],
        synced: bool | None = None,
        candidates: dict[PodKey, PodInfo] | None = None,
    ) -> None:
        if self._stop.is_set():
            return  # nothing changes after stop
        if candidates is None:
            candidates = {key: pod for key, pod in pods.items() if self._candidate(pod)}
        with self._cache_lock:
            self._cache = (pods, tuple(pods.values()))
            if candidates is not self._candidate_keys:
                self._candidate_keys = candidates
                self._candidates = tuple(candidates.values())
            if synced is not None:
                self._synced = synced
        self.changes.bump()

    # --- the thread --------------------------------------------------------

    def _run(self) -> None:
        backoff = self._backoff
        resource_version: str | None = None
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                if resource_version is None:
                    resource_version = self._relist()
                resource_version = self._follow(resource_version)
                if time.monotonic() - began >= 1.0:
                    backoff.reset()
                    continue  # the server ended a long watch: resume at once
                delay = backoff.next_delay_seconds()  # ended at once: do not spin
            except KubeExpired:
                log.info("pod watch: resourceVersion %s expired, listing again", resource_version)
                resource_version = None
                with self._cache_lock:
                    self._synced = False
                if time.monotonic() - began >= 1.0:
                    continue
                delay = backoff.next_delay_seconds()  # expired at once again: do not spin
            except KubeApiError as e:
                delay = backoff.next_delay_seconds()
                log.debug("pod watch failed, again in %.1f s: %s", delay, e)
                if not isinstance(e, (KubeUnavailable, KubeForbidden)):  # those are logged
                    self._session.log_once(f"pod watch: {e}", logging.WARNING)
            except Exception:  # a bug must not end the watch for the daemon's lifetime
                delay = backoff.next_delay_seconds()
                log.exception("pod watch failed, again in %.1f s", delay)
            self._stop.wait(delay)

    def _relist(self) -> str:
        """LIST this node's pods into the cache; the list's resourceVersion."""
        body = self._session.call(
            "list",
            "pods",
            self._session.core.list_pod_for_all_namespaces,
            field_selector=self._selector,
        )
        pods = {}
        for item in body.get("items") or ():
            info = pod_info(item)
            pods[(info.namespace, info.name)] = info
        self._publish(pods, synced=True)
        return (body.get("metadata") or {}).get("resourceVersion") or ""

    def _follow(self, resource_version: str) -> str:
        """WATCH from ``resource_version`` until the stream ends; the last version seen."""
        session = self._session
        try:
            response = session.core.list_pod_for_all_namespaces(
                watch=True,
                field_selector=self._selector,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_seconds,
                _preload_content=False,
                # The server ends the watch after timeout_seconds; a read that
                # waits longer than that means the connection died silently.
                _request_timeout=(
                    session.timeout_seconds,
                    self._watch_timeout_seconds + 2 * session.timeout_seconds,
                ),
            )
        except Exception as e:
            error = map_error(e, "watch", "pods")
            if error.status == 504 and "too large resource version" in str(error).lower():
                # The server's versions went back (etcd restored, a new
                # cluster at the same address): ours means nothing there.
                raise KubeExpired(str(error), 504) from e
            session.note_error(error)
            raise error from e
        with self._response_lock:
            self._response = response
        self.watching = True
        session.note_ok()
        try:
            if self._stop.is_set():  # stop came before the response was registered
                return resource_version
            for line in _lines(response):
                if self._stop.is_set():
                    break
                if line.strip():
                    resource_version = self._apply(json.loads(line), resource_version)
        except KubeApiError as e:  # an ERROR event in the stream
            session.note_error(e)
            raise
        except Exception as e:
            if self._stop.is_set():
                return resource_version
            error = map_error(e, "watch", "pods")
            session.note_error(error)
            raise error from e
        finally:
            self.watching = False
            with self._response_lock:
                self._response = None
            _close_response(response)
        return resource_version

    def _apply(self, event: Mapping[str, Any], resource_version: str) -> str:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            raise status_error(obj, "watch", "pods")
        new_version = (obj.get("metadata") or {}).get("resourceVersion") or resource_version
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return new_version  # BOOKMARK: only the version moves
        info = pod_info(obj)
        key = (info.namespace, info.name)
        pods = dict(self._cache[0])  # copy on write: readers keep their snapshot
        candidates = self._candidate_keys
        gone = kind == "DELETED" or (info.node_name and info.node_name != self._node_name)
        if gone:
            pods.pop(key, None)
        else:
            pods[key] = info
        if key in candidates or (not gone and self._candidate(info)):
            candidates = dict(candidates)  # small: the pending GPU pods only
            if gone or not self._candidate(info):
                candidates.pop(key, None)
            else:
                candidates[key] = info
        self._publish(pods, candidates=candidates)
        return new_version


def _lines(response: Any) -> Iterator[str]:
    """The newline-separated JSON documents of a watch stream, as they arrive."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace")
    if buffer.strip():
        yield buffer.decode("utf-8", "replace")


def _wake_reader(response: Any) -> None:
    """Make a read of the stream blocked in another thread return (at EOF).

    Only shutdown() of the socket does: close() does not interrupt a blocked
    recv(), and closing the response waits for the reader's buffer lock.
    """
    connection = getattr(response, "connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _close_response(response: Any) -> None:
    """Close a stream this thread has stopped reading (its connection is not reused)."""
    _wake_reader(response)
    try:
        response.close()
    except Exception:  # already closed: done either way
        pass


# --- pods from the API -------------------------------------------------------


def pod_info(pod: Any) -> PodInfo:
    """A pod from the API as PodInfo: a raw JSON dict (camelCase) or a ``V1Pod``."""
    data = pod if isinstance(pod, Mapping) else pod.to_dict(serialize=True)
    metadata = data.get("metadata") or {}
    spec = data.get("spec") or {}
    status = data.get("status") or {}
    return PodInfo(
        namespace=metadata.get("namespace") or "",
        name=metadata.get("name") or "",
        uid=metadata.get("uid") or "",
        node_name=spec.get("nodeName") or "",
        phase=status.get("phase") or "Pending",  # no status yet: just created
        created_at=_unix_seconds(metadata.get("creationTimestamp")),
        deleting=metadata.get("deletionTimestamp") is not None,
        annotations=dict(metadata.get("annotations") or {}),
        containers=tuple(_container(c) for c in spec.get("containers") or ()),
        init_containers=tuple(_container(c) for c in spec.get("initContainers") or ()),
        resource_version=metadata.get("resourceVersion") or "",
    )


def is_extended_resource(name: str) -> bool:
    """A resource named ``<domain>/<name>`` outside kubernetes.io (device plugin resources)."""
    domain, slash, _ = name.partition("/")
    if not slash or name.startswith("requests."):
        return False
    return not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io"))


def extended_requests(resources: Mapping[str, Any] | None) -> dict[str, int]:
    """Integer requests of the extended resources; a limit alone counts as the request.

    The API server copies limits into requests for extended resources (they
    must be equal), but a pod seen before defaulting, or a hand-made dict,
    may carry the limit only. A quantity that is not a whole number cannot be
    an extended resource request and is left out.
    """
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
    """RFC 3339 text (raw JSON) or a datetime (V1Pod) as Unix seconds; 0.0 when missing."""
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
