"""The DRA side of the Kubernetes edge: the node's ResourceSlice, claims' status, refusals.

- ``DraPublisher`` (a thread) queues on the adapter the node's ResourceSlice
  (``nodemgr.domain.slices``) and each prepared claim's ``status.devices`` (a ``Ready``
  condition with what it holds and its isolation); the slice again every
  ``SLICE_CHECK_SECONDS``, since kubelet deletes a node's slices at its start and 30 s
  after a driver left.
- ``SliceWriter`` and ``ClaimStatusWriter``: read, compare, create or replace with the
  read resourceVersion (a conflict is retried). ``pool.generation`` grows with every
  change from the highest the API showed; the Node owns the slice.
- ``remove_slice``: queued at start when DRA is disabled but was publishing.
- ``ClaimEvents``: a refused claim as an Event on each pod it is reserved for.

What it must not do: write anything on the prepare path (everything is queued), or
touch slices of another node or driver.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from nodemgr.allocation.allocator import Allocator
from nodemgr.common.workers import ThreadWorker
from nodemgr.domain import quantity
from nodemgr.domain.model import Allocation
from nodemgr.domain.slices import device_of, plugin_use, slice_cards, slice_spec
from nodemgr.errors import KubeNotFound, KubeUnavailable

if TYPE_CHECKING:  # the client is imported only when used
    from nodemgr.kubernetes.client import ApiSession

log = logging.getLogger(__name__)

# Besides the adapter's API_PERMISSIONS; `render.py dra`'s ClusterRole grants exactly
# these (a test compares them). Kubernetes 1.36+ checks resourceclaims/driver (for this
# driver's name) when a driver writes status.devices.
DRA_API_PERMISSIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("resource.k8s.io", "resourceclaims", ("get",)),
    ("resource.k8s.io", "resourceclaims/status", ("update",)),
    ("resource.k8s.io", "resourceslices", ("get", "create", "update", "delete")),
    ("resource.k8s.io", "resourceclaims/driver", ("associated-node:update",)),
)

SLICE_WRITE = "resource-slice"
SLICE_DELETE = "resource-slice-delete"
CLAIM_STATUS = "claim-status"
SLICE_CHECK_SECONDS = 10.0
MIN_PUBLISH_INTERVAL_SECONDS = 1.0
REFUSAL_REASON = "GPUShareClaimRefused"
CONDITION_TYPE = "Ready"
META_SLICE = "dra_slice"  # ledger meta: the slice this node published


def slice_name(node: str, driver: str) -> str:
    """The node's slice: ``<node>-<driver>``, or a hashed name when that is too long."""
    name = f"{node}-{driver}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"{node[:200].rstrip('.-')}-{digest}"


# ------------------------------------------------------------------------- the writers


def _rfc3339(unix_seconds: float) -> str:
    return datetime.fromtimestamp(unix_seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class SliceWriter:
    def __init__(self, node: str, driver: str, on_written: Callable[[], None] = lambda: None):
        self.node, self.driver = node, driver
        self.name = slice_name(node, driver)
        self.generation = 0  # the highest seen or written
        self._node_uid: str | None = None
        self._on_written = on_written

    def write(self, session: ApiSession, key: tuple, devices: list[dict[str, Any]]) -> None:
        resource = f"resourceslices/{self.name}"
        try:
            current = session.call("get", resource, session.resource.read_resource_slice, self.name)
        except KubeNotFound:
            current = None
        if current is not None:
            spec = current.get("spec") or {}
            seen = int((spec.get("pool") or {}).get("generation") or 0)
            self.generation = max(self.generation, seen)
            if _same_slice(spec, self.node, self.driver, devices):
                self._on_written()
                return
            body = dict(current)
            body["spec"] = slice_spec(self.node, self.driver, devices, self.generation + 1)
            session.call(
                "update", resource, session.resource.replace_resource_slice, self.name, body
            )
        else:
            body = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": self.name, "ownerReferences": [self._owner(session)]},
                "spec": slice_spec(self.node, self.driver, devices, self.generation + 1),
            }
            session.call("create", resource, session.resource.create_resource_slice, body)
            log.info("published ResourceSlice %s (%d devices)", self.name, len(devices))
        self.generation += 1
        self._on_written()

    def _owner(self, session: ApiSession) -> dict[str, Any]:
        if self._node_uid is None:
            try:
                node = session.call("get", f"nodes/{self.node}", session.core.read_node, self.node)
            except KubeNotFound as e:  # retried: the Node appears when kubelet registers
                raise KubeUnavailable(f"node {self.node} is not registered yet: {e}") from e
            self._node_uid = str((node.get("metadata") or {}).get("uid") or "")
        return {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self._node_uid,
                "controller": True}  # fmt: skip

    def delete(self, session: ApiSession, key: tuple, _value: Any) -> None:
        try:
            session.call(
                "delete",
                f"resourceslices/{self.name}",
                session.resource.delete_resource_slice,
                self.name,
            )
            log.info("removed ResourceSlice %s (the DRA plugin is disabled)", self.name)
        except KubeNotFound:
            pass
        self._on_written()


def _same_slice(spec: Mapping[str, Any], node: str, driver: str, devices: list) -> bool:
    pool = spec.get("pool") or {}
    return (
        spec.get("driver") == driver
        and spec.get("nodeName") == node
        and pool.get("name") == node
        and pool.get("resourceSliceCount") == 1
        and _normal(spec.get("devices") or []) == _normal(devices)
    )


def _normal(value: Any, key: str = "") -> Any:
    """Quantities as numbers: the API stores them canonically (1024Mi reads back as 1Gi)."""
    if isinstance(value, dict):
        return {k: _normal(v, k) for k, v in value.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_normal(v, key) for v in value]
    if key in ("value", "default", "min", "max", "step", "validValues") and isinstance(value, str):
        try:
            return quantity.parse(value)
        except quantity.QuantityError:
            return value
    return value


class ClaimStatusWriter:
    """Keeps other drivers' entries."""

    def __init__(self, driver: str):
        self.driver = driver

    def write(self, session: ApiSession, key: tuple, devices: list[dict[str, Any]]) -> None:
        _, namespace, name, uid = key
        resource = f"resourceclaims/{namespace}/{name}"
        claim = session.call(
            "get", resource, session.resource.read_namespaced_resource_claim, name, namespace
        )
        if (claim.get("metadata") or {}).get("uid") != uid:
            return  # deleted and made again: that one is not ours to describe
        status = dict(claim.get("status") or {})
        if not status.get("allocation"):
            return
        current = list(status.get("devices") or [])
        others = [d for d in current if d.get("driver") != self.driver]
        mine = [d for d in current if d.get("driver") == self.driver]
        if _normal(mine) == _normal(devices):
            return
        status["devices"] = others + devices
        if not status["devices"]:
            del status["devices"]
        body = dict(claim)
        body["status"] = status
        session.call(
            "update",
            f"{resource}/status",
            session.resource.replace_namespaced_resource_claim_status,
            name,
            namespace,
            body,
        )


def claim_device_status(
    driver: str, allocation: Allocation, isolation: Mapping[str, str] | None, label: str
) -> list[dict[str, Any]]:
    claim = allocation.claim
    assert claim is not None
    if allocation.whole:
        holds = f"{label} whole"
    else:
        holds = f"{allocation.memory_mib} MiB + {allocation.core_percent} % of {label}"
    levels = (
        f"memory {isolation['memory']}, compute {isolation['compute']}"
        if isolation
        else "isolation not known yet"
    )
    data: dict[str, Any] = {
        "gpus": list(allocation.cards),
        "whole": allocation.whole,
        "memoryMiB": allocation.memory_mib,
        "corePercent": allocation.core_percent,
    }
    if isolation:
        data["isolation"] = {"memory": isolation["memory"], "compute": isolation["compute"]}
    entries = []
    for result in claim.results:
        entry: dict[str, Any] = {"driver": driver, "pool": result.pool, "device": result.device}
        if result.share_id is not None:
            entry["shareID"] = result.share_id
        entry["conditions"] = [
            {
                "type": CONDITION_TYPE,
                "status": "True",
                "reason": "Prepared",
                "message": f"gpushare-node prepared {holds}; {levels} (nodemgr status)",
                "lastTransitionTime": _rfc3339(allocation.created_at),
            }
        ]
        entry["data"] = data
        entries.append(entry)
    return entries


# ------------------------------------------------------------------------- the publisher


class DraPublisher(ThreadWorker):
    def __init__(
        self,
        adapter: Any,
        allocator: Allocator,
        status_document: Callable[[], dict[str, Any]],
        *,
        driver: str,
        unit_mib: int,
        mps_enabled: bool,
        device_names: Mapping[str, str],
        driver_version: str | None,
        set_meta: Callable[[str, str], None] = lambda key, value: None,
    ):
        super().__init__("dra-publisher")
        self._adapter = adapter
        self._allocator = allocator
        self._status_document = status_document
        self.node = allocator.node_name
        self.driver = driver
        self._unit_mib = unit_mib
        self._mps_enabled = mps_enabled
        self._names = dict(device_names)
        self._driver_version = driver_version
        self.slices = SliceWriter(self.node, driver)
        self._claims = ClaimStatusWriter(driver)
        self._set_meta = set_meta
        self._sent_claims: dict[tuple, list] = {}
        adapter.add_writer(SLICE_WRITE, self.slices.write)
        adapter.add_writer(CLAIM_STATUS, self._claims.write)

    def _wake(self) -> None:
        self._allocator.changes.wake_all()

    def devices(self) -> list[dict[str, Any]]:
        cards = slice_cards(
            self._allocator.cards,
            self._unit_mib,
            plugin_use(self._allocator.allocations()),
            self._allocator.card_problems(),
            self._mps_enabled,
            self._names,
        )
        offered = (device_of(card, self._unit_mib, self._driver_version) for card in cards)
        return [device for device in offered if device is not None]

    def run(self, stop: threading.Event) -> None:
        try:
            self._set_meta(META_SLICE, self.slices.name)
        except Exception:  # the slice is then not removed if DRA is disabled later
            log.exception("cannot note the published slice in the ledger")
        changes = self._allocator.changes
        generation, next_check, last = -1, 0.0, float("-inf")
        sent_devices: list | None = None
        while not stop.is_set():
            now = time.monotonic()
            if now < last + MIN_PUBLISH_INTERVAL_SECONDS:
                stop.wait(last + MIN_PUBLISH_INTERVAL_SECONDS - now)
                continue
            generation = changes.generation
            try:
                devices = self.devices()
                if devices != sent_devices or now >= next_check:
                    self._adapter.queue_write((SLICE_WRITE, self.slices.name), devices)
                    sent_devices, next_check = devices, now + SLICE_CHECK_SECONDS
                self._publish_claims()
            except Exception:  # the next change or check tries again
                log.exception("publishing the DRA state failed")
            last = now
            wait = max(next_check - time.monotonic(), 0.0)
            changes.wait_for_change(generation, wait)

    def _publish_claims(self) -> None:
        claims = self._allocator.claim_allocations()
        if not claims and not self._sent_claims:
            return
        rows = {a["id"]: a for a in self._status_document().get("allocations", [])}
        desired: dict[tuple, list] = {}
        for allocation in claims:
            claim = allocation.claim
            assert claim is not None
            row = rows.get(allocation.id) or {}
            label = ", ".join(self._allocator.card_label(c) for c in allocation.cards)
            key = (CLAIM_STATUS, claim.namespace, claim.name, claim.uid)
            desired[key] = claim_device_status(self.driver, allocation, row.get("isolation"), label)
        for key in self._sent_claims.keys() - desired.keys():
            desired[key] = []  # unprepared: our entries go (if the claim is still there)
        for key, entries in desired.items():
            if self._sent_claims.get(key) != entries:
                self._adapter.queue_write(key, entries)
        self._sent_claims = {k: v for k, v in desired.items() if v}


def remove_slice(adapter: Any, node: str, driver: str, clear_meta: Callable[[], None]) -> None:
    writer = SliceWriter(node, driver, on_written=clear_meta)
    adapter.add_writer(SLICE_DELETE, writer.delete)
    adapter.queue_write((SLICE_DELETE, writer.name), None)


# ------------------------------------------------------------------------- refusals


class ClaimEvents:
    """nodemgr.dra.driver.ClaimReports: a refused claim as an Event on its pods."""

    def __init__(self, adapter: Any):
        self._adapter = adapter

    def refused(self, claim: Mapping[str, Any] | None, key: Any, message: str) -> None:
        reserved = ((claim or {}).get("status") or {}).get("reservedFor") or []
        pods = [
            r.get("name") for r in reserved if isinstance(r, dict) and r.get("resource") == "pods"
        ]
        for pod in pods:
            if isinstance(pod, str) and pod:
                self._adapter.record_event(key.namespace, pod, REFUSAL_REASON, message)
