"""What the next reconcile must judge: the work follows what changed, not what is held.

A reconcile compares the allocations with kubelet's record. Once it has, an
allocation stays settled (judging it again would change nothing) until it
changes, kubelet's record changes for one of its devices, or, unconfirmed and
unreported, its grace ends. So the allocator tells the backlog of every
committed change (``changed``), and a reconcile judges only:

- the allocations changed since the last reconcile, and the devices they let go
  (kubelet may report one that nobody holds now: it is adopted);
- the devices whose entry in kubelet's record changed, and their holders (the
  record is compared with the one the state was last judged against, only when
  it is another object: the PodResources client hands back the same object
  while kubelet's answer is unchanged);
- the unconfirmed allocations whose grace may have ended, from an index ordered
  by creation time (a heap: the earliest is looked at, nothing else);
- not judged but handed along, the allocations that may merge with those (they
  hold a device kubelet reports for the same container).

A full walk (every allocation) is judged at start, with ID hints (they need
every live ID), and after a plan could not be committed.

Bookkeeping, no I/O, no lock of its own: the allocator calls it under its lock
(``KubeletView.read``, a walk of a new record, it calls without).

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
    """kubelet's record as this node reads it: each of its devices kubelet reports, with
    the container holding it; ``record`` is the object it was read from."""

    record: object
    reported: Mapping[DeviceKey, ContainerRef]

    @classmethod
    def read(
        cls,
        record: Mapping[ContainerRef, Mapping[str, Sequence[str]]],
        kind_of_resource: Mapping[str, ResourceKind],
        is_known: Callable[[ResourceKind, str], bool],
    ) -> KubeletView:
        """The devices of this node's resources that ``record`` reports (one walk of it);
        a device this node does not advertise is logged and left out."""
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
        """The devices kubelet reports for each container (built on first use)."""
        keys: dict[ContainerRef, list[DeviceKey]] = defaultdict(list)
        for key, ref in self.reported.items():
            keys[ref].append(key)
        return {ref: tuple(held) for ref, held in keys.items()}


@dataclass(frozen=True)
class Work:
    """One reconcile's share of the backlog: what it judges, and what it took off the
    backlog (given back if its plan cannot be committed)."""

    full: bool  # every allocation judged: ``everything``
    scope: ReconcileScope | None  # what is judged when not full; None: nothing is
    view: KubeletView
    ids: frozenset[str]  # the changed allocations taken off the backlog
    keys: frozenset[DeviceKey]  # the changed devices taken off the backlog
    everything: tuple[Allocation, ...] = ()  # every allocation, for a full walk

    @property
    def nothing(self) -> bool:
        """Nothing to judge: the record and the state are as they were last judged."""
        return not self.full and self.scope is None


class Backlog:
    def __init__(self) -> None:
        self._full = True  # nothing judged yet: the first reconcile walks everything
        self._ids: set[str] = set()  # allocations changed (or due) since the last reconcile
        self._keys: set[DeviceKey] = set()  # devices an allocation let go since then
        # (created_at, ID) of the allocations a reconcile judged and left waiting for
        # kubelet's record: a heap, earliest first. An entry whose allocation was confirmed
        # or released since is dropped when it comes up.
        self._deadlines: list[tuple[float, str]] = []
        # kubelet's record as the state was last judged against it.
        self._judged_against: KubeletView | None = None

    def changed(self, old: Allocation | None, new: Allocation | None) -> None:
        """An allocation was committed (``new``; None: released) in place of ``old``."""
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
        """Put the unconfirmed allocations whose grace ended on the backlog."""
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
        """Nothing to judge against this very record object (call ``expire`` first)."""
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
        """What a reconcile against ``view`` judges (``full``: every allocation, whatever
        the backlog). Reads the backlog; ``take`` takes it off."""
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
        # A DRA claim's allocation is released by unprepare, never by kubelet's device
        # plugin record: it is judged by no reconcile, and no merge takes it along.
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
        """Take ``work`` off the backlog: the state is judged against its view from now on.
        Returns what it was judged against before (for ``give_back``)."""
        before = self._judged_against
        if work.full:
            self._full = False
        self._ids.difference_update(work.ids)
        self._keys.difference_update(work.keys)
        self._judged_against = work.view
        return before

    def give_back(self, work: Work, judged_against: KubeletView | None) -> None:
        """``work``'s plan was not committed: it is judged again next time."""
        self._full = self._full or work.full
        self._ids.update(work.ids)
        self._keys.update(work.keys)
        self._judged_against = judged_against

    def settled(self, work: Work, allocations: Mapping[str, Allocation]) -> None:
        """After ``work``'s plan was committed: every allocation it judged that still waits
        for kubelet is back in the deadline index (a clock that stepped back can leave one
        judged due that is not yet)."""
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
    """The devices whose entry differs between two reads of kubelet's record."""
    changed = {key for key, ref in after.items() if before.get(key) != ref}
    changed.update(key for key in before if key not in after)
    return changed
