"""What the next reconcile must judge: the work follows what changed, not what is held.

Once judged against kubelet's record, an allocation stays settled until it changes,
kubelet's record changes for one of its devices, or, unconfirmed, its grace ends. So a
reconcile judges only:

- the allocations changed since the last one, and the devices they let go (kubelet
  may report one nobody holds now: it is adopted);
- the devices whose entry in kubelet's record changed, and their holders (compared
  only when the record is another object: the PodResources client hands back the
  same object while kubelet's answer is unchanged);
- the unconfirmed allocations whose grace may have ended (a heap by creation time);
- handed along unjudged, the allocations that may merge with those.

A full walk is judged at start, with ID hints (they need every live ID), and after a
plan could not be committed. No I/O, no lock of its own: the allocator calls it under
its lock (``KubeletView.read`` without).

What it must not do: decide anything about an allocation (nodemgr.domain.reconcile
does); hold allocations of its own (it holds IDs and device keys; the
allocations are the ledger's).
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation, ContainerRef
from nodemgr.domain.reconcile import DeviceKey, ReconcileScope

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KubeletView:
    """Each of this node's devices kubelet's ``record`` reports, with its container."""

    record: object
    reported: Mapping[DeviceKey, ContainerRef]

    @classmethod
    def read(
        cls,
        record: Mapping[ContainerRef, Mapping[str, Sequence[str]]],
        kind_of_resource: Mapping[str, ResourceKind],
        is_known: Callable[[ResourceKind, str], bool],
    ) -> KubeletView:
        """One walk of ``record``; a device this node does not advertise is logged and
        left out."""
        reported = {}
        for ref, resources in record.items():
            for resource_name, device_ids in resources.items():
                kind = kind_of_resource.get(resource_name)
                if kind is None:
                    continue
                for device_id in device_ids:
                    if is_known(kind, device_id):
                        reported[(kind, device_id)] = ref
                    else:
                        log.warning(
                            "kubelet reports %s device %s for %s, which this node does not "
                            "advertise (GPU removed or memory unit changed?)",
                            resource_name,
                            device_id,
                            ref,
                        )
        return cls(record, reported)

    @functools.cached_property
    def by_container(self) -> Mapping[ContainerRef, tuple[DeviceKey, ...]]:
        keys: dict[ContainerRef, list[DeviceKey]] = defaultdict(list)
        for key, ref in self.reported.items():
            keys[ref].append(key)
        return {ref: tuple(held) for ref, held in keys.items()}


@dataclass(frozen=True)
class Work:
    """One reconcile's share of the backlog (given back if its plan cannot be committed)."""

    full: bool  # every allocation judged: ``everything``
    scope: ReconcileScope | None  # None: nothing is judged
    view: KubeletView
    ids: frozenset[str]  # taken off the backlog
    keys: frozenset[DeviceKey]  # taken off the backlog
    everything: tuple[Allocation, ...] = ()

    @property
    def nothing(self) -> bool:
        return not self.full and self.scope is None


class Backlog:
    def __init__(self) -> None:
        self._full = True
        self._ids: set[str] = set()  # changed (or due) since the last reconcile
        self._keys: set[DeviceKey] = set()  # let go since then
        # (created_at, ID) of those left waiting for kubelet's record; an entry confirmed
        # or released since is dropped when it comes up.
        self._deadlines: list[tuple[float, str]] = []
        self._judged_against: KubeletView | None = None

    def changed(self, old: Allocation | None, new: Allocation | None) -> None:
        """``new`` (None: released) was committed in place of ``old``."""
        if old is not None:
            let_go = old.device_pairs()
            if new is not None:
                kept = set(new.device_pairs())
                let_go = [key for key in let_go if key not in kept]
            self._keys.update(let_go)
        if new is not None and new.claim is None:  # claims are not reconciled (see work)
            self._ids.add(new.id)

    def expire(
        self, now: float, grace_seconds: float, allocations: Mapping[str, Allocation]
    ) -> None:
        deadlines = self._deadlines
        while deadlines and now - deadlines[0][0] > grace_seconds:
            created_at, allocation_id = heapq.heappop(deadlines)
            allocation = allocations.get(allocation_id)
            if (
                allocation is not None
                and allocation.confirmed_at is None
                and allocation.created_at == created_at
            ):
                self._ids.add(allocation_id)

    def idle(self, record: object) -> bool:
        """Call ``expire`` first."""
        judged = self._judged_against
        return (
            not self._full
            and not self._ids
            and not self._keys
            and judged is not None
            and judged.record is record
        )

    def work(
        self,
        view: KubeletView,
        allocations: Mapping[str, Allocation],
        holders: Mapping[DeviceKey, str],
        full: bool = False,
    ) -> Work:
        """What a reconcile against ``view`` judges; ``take`` takes it off the backlog."""
        ids, keys = frozenset(self._ids), frozenset(self._keys)
        judged_against = self._judged_against
        if full or self._full or judged_against is None:
            return Work(True, None, view, ids, keys, tuple(allocations.values()))
        if judged_against.record is not view.record:
            keys = keys | _differing(judged_against.reported, view.reported)
        if not ids and not keys:
            return Work(False, None, view, ids, keys)
        reported = view.reported
        judged_ids = {i for i in ids if i in allocations}
        judged_ids.update(holders[key] for key in keys if key in holders)
        # A claim's allocation is released by unprepare, never by the device plugin record.
        judged_ids = {i for i in judged_ids if allocations[i].claim is None}
        unheld = {key: reported[key] for key in keys if key in reported and key not in holders}
        judged = tuple(allocations[i] for i in sorted(judged_ids))
        containers = {
            reported[key] for allocation in judged for key in allocation.device_pairs()
            if key in reported
        }  # fmt: skip
        containers.update(unheld.values())
        other_ids = {
            holders[key]
            for ref in containers
            for key in view.by_container.get(ref, ())
            if key in holders
        } - judged_ids
        others = tuple(allocations[i] for i in sorted(other_ids) if allocations[i].claim is None)
        return Work(False, ReconcileScope(judged, unheld, others), view, ids, keys)

    def take(self, work: Work) -> KubeletView | None:
        """Returns what the state was judged against before (for ``give_back``)."""
        before = self._judged_against
        if work.full:
            self._full = False
        self._ids.difference_update(work.ids)
        self._keys.difference_update(work.keys)
        self._judged_against = work.view
        return before

    def give_back(self, work: Work, judged_against: KubeletView | None) -> None:
        self._full = self._full or work.full
        self._ids.update(work.ids)
        self._keys.update(work.keys)
        self._judged_against = judged_against

    def settled(self, work: Work, allocations: Mapping[str, Allocation]) -> None:
        """After ``work``'s plan was committed: those still waiting for kubelet go back in
        the deadline index (a clock that stepped back can make one due too early)."""
        if work.full:
            judged: Iterable[Allocation | None] = allocations.values()
        elif work.scope is not None:
            judged = (allocations.get(a.id) for a in work.scope.judged)
        else:
            judged = ()
        for allocation in judged:
            if allocation is not None and allocation.confirmed_at is None:
                heapq.heappush(self._deadlines, (allocation.created_at, allocation.id))


def _differing(
    before: Mapping[DeviceKey, ContainerRef], after: Mapping[DeviceKey, ContainerRef]
) -> set[DeviceKey]:
    changed = {key for key, ref in after.items() if before.get(key) != ref}
    changed.update(key for key in before if key not in after)
    return changed
