"""Between the allocator and the Kubernetes adapter: pods in, annotations and events out.

- ``CandidatePods``: the allocator's pod source;
- ``Publisher`` (a thread) sends the adapter what changed of the pods' gpushare
  annotations, the node's labels, per-card annotation and ``aliyun.com/gpu-count``;
  the adapter queues and retries, so an API server down blocks nothing;
- ``post_refusal`` / ``post_violation``: pod Events (rate-limited by the adapter).

What it must not do: decide anything (podmatch and publish do), or call
the API server itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nodemgr.allocation.allocator import Allocator
from nodemgr.common.workers import ThreadWorker
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.podmatch import Demand, PodInfo, is_candidate_pod
from nodemgr.errors import final_refusal
from nodemgr.kubernetes.publish import (
    GPU_COUNT_RESOURCE,
    NODE_ANNOTATION,
    isolation_by_allocation,
    node_annotation,
    node_labels,
    pod_annotations,
)

log = logging.getLogger(__name__)

# For the memory used (other changes publish at once). A publish walks every pod and
# allocation: every 5 s it would be an idle full node's largest cost.
PUBLISH_PERIOD_SECONDS = 30.0
# A burst of admissions is one recomputation, not one each.
MIN_PUBLISH_INTERVAL_SECONDS = 1.0
REPUBLISH_SECONDS = 60.0  # everything again, whether or not it changed
REFUSAL_REASON = "GPUShareRefused"
VIOLATION_REASON = "GPUQuotaViolation"


class CandidatePods:
    """The allocator's PodSource over the adapter's candidate index."""

    def __init__(self, adapter):
        self._adapter = adapter

    @property
    def live(self) -> bool:
        state = self._adapter.state()
        return bool(state.get("synced") and state.get("watching"))

    @property
    def generation(self) -> int:
        return self._adapter.generation

    def wait_for_change(self, seen_generation: int, timeout: float) -> int:
        return self._adapter.wait_for_change(seen_generation, timeout)

    def candidates(self) -> list[PodInfo]:
        return list(self._adapter.candidates())

    def pod(self, namespace: str, name: str) -> PodInfo | None:
        return self._adapter.pod(namespace, name)

    def candidates_asking(self, resource: str, size: int) -> tuple[PodInfo, ...]:
        """The adapter's immutable bucket itself: no copy per Allocate."""
        return self._adapter.candidates_asking(resource, size)


def candidate_filter(resources: tuple[str, ...]):
    return lambda pod: is_candidate_pod(pod, resources)


class Publisher(ThreadWorker):
    def __init__(
        self,
        adapter,
        allocator: Allocator,
        status_document: Callable[[], dict],
        memory_unit_mib: int,
        mps_enabled: bool,
        label_prefix: str,
    ):
        super().__init__("kube-publisher")
        self._adapter = adapter
        self._label_prefix = label_prefix
        self._allocator = allocator
        self._status_document = status_document
        self._unit_mib = memory_unit_mib
        self._mps_enabled = mps_enabled
        self._sent_pods: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}
        self._sent_node: tuple | None = None

    def _wake(self) -> None:
        self._allocator.changes.wake_all()

    def run(self, stop: threading.Event) -> None:
        changes = self._allocator.changes
        generation, next_publish, next_full = -1, 0.0, 0.0
        pending, last_publish = True, float("-inf")
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_full:
                # Recovers a dropped write (pod not there yet, RBAC fixed since) and
                # gpu-count that kubelet reset when it re-registered the node.
                self._sent_pods, self._sent_node = {}, None
                next_full = now + REPUBLISH_SECONDS
            if (pending and now >= last_publish + MIN_PUBLISH_INTERVAL_SECONDS) or (
                now >= next_publish
            ):
                generation = changes.generation  # the publish reads the state after it
                try:
                    self.publish()
                except Exception:  # the next change or period tries again
                    log.exception("publishing to the Kubernetes API failed")
                pending, last_publish = False, now
                next_publish = now + PUBLISH_PERIOD_SECONDS
            # Wait until something is due (a stop ends it at once), never on a short timer.
            if pending:
                # A publish is owed and reads the state when it runs: sleeping through the
                # changes until then (several per admission) spares a busy node's GIL.
                stop.wait(max(last_publish + MIN_PUBLISH_INTERVAL_SECONDS - now, 0.0))
                continue
            due = min(next_publish, next_full) - time.monotonic()
            seen, generation = generation, changes.wait_for_change(generation, max(due, 0.0))
            pending = generation != seen

    def publish(self) -> None:
        pods = {(p.namespace, p.name): p for p in self._adapter.pods()}
        status = self._status_document()
        desired = pod_annotations(
            self._allocator.allocations(),
            self._allocator.cards,
            self._unit_mib,
            pods,
            memory_resource=self._allocator.resource_names[ResourceKind.MEMORY],
            core_resource=self._allocator.resource_names[ResourceKind.CORE],
            isolation=isolation_by_allocation(status),
            label_prefix=self._label_prefix,
        )
        for key, wanted in desired.items():
            # By UID too: a pod created again under its name has none of them yet.
            sent = (pods[key].uid, wanted)
            if self._sent_pods.get(key) != sent:
                self._adapter.patch_pod_annotations(key[0], key[1], dict(wanted))
                self._sent_pods[key] = sent
        for key in [k for k in self._sent_pods if k not in desired]:
            del self._sent_pods[key]  # released: the pod is gone or lost its GPUs
        labels = node_labels(self._allocator.cards, self._mps_enabled)
        annotation = node_annotation(status)
        node = (tuple(sorted(labels.items())), annotation)
        if node != self._sent_node:
            self._adapter.set_node_labels(labels)
            self._adapter.set_node_annotations({self._label_prefix + NODE_ANNOTATION: annotation})
            self._adapter.set_node_extended_resources(
                {GPU_COUNT_RESOURCE: len(self._allocator.cards)}
            )
            self._sent_node = node


def post_refusal(adapter, demand: Demand, message: str) -> None:
    adapter.record_event(demand.namespace, demand.pod, REFUSAL_REASON, final_refusal(message))


def post_violation(adapter, violation, card_label: str, action: str) -> None:
    if violation.owner is None:
        return  # a process of no known pod: the log and the ledger have it
    adapter.record_event(
        violation.owner.namespace,
        violation.owner.pod,
        VIOLATION_REASON,
        f"container {violation.owner.container} on {card_label}: {violation.detail} "
        f"(action: {action})",
    )
