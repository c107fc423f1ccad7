"""Comparing the ledger with kubelet's PodResources record (pure).

kubelet's record wins, always:

- an allocation kubelet reports gets its owner;
- one kubelet no longer reports is released: at once when kubelet had shown it (the
  pod is gone), after ``allocation_grace_seconds`` while kubelet may not have caught up;
- one whose devices kubelet reports for two containers is split (the daemon guessed
  the container linkage wrong);
- an allocation's ``owner_uid`` stays while kubelet names a container of that pod and
  is dropped when it names another; allocations of two pods of one name are never
  merged, whatever a record read between the two says;
- devices kubelet reports that the ledger does not hold (ledger lost, or older than
  kubelet's checkpoint) are adopted, so never handed out twice, under the ID their
  containers were registered with where their cgroup marks say it (``id_hints``).

``plan_reconcile`` is the full walk and the oracle of ``plan_scoped``, which judges
only a :class:`ReconcileScope` (what changed since the last reconcile and what may
merge with it) and makes the same plan when everything outside it was settled (the
allocator keeps that true; a property test holds the two to each other).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from nodemgr.domain.deviceids import ResourceKind, card_of
from nodemgr.domain.model import Allocation, ContainerRef

DeviceKey = tuple[ResourceKind, str]


@dataclass
class ReconcilePlan:
    put: list[Allocation] = field(default_factory=list)  # new or changed allocations
    delete: list[str] = field(default_factory=list)  # allocation IDs to release
    notes: list[str] = field(default_factory=list)  # one log line per change

    @property
    def empty(self) -> bool:
        return not self.put and not self.delete


@dataclass(frozen=True)
class ReconcileScope:
    """What one reconcile judges; outside it everything is settled against kubelet's record."""

    judged: tuple[Allocation, ...]  # each compared with kubelet's record
    unheld: Mapping[DeviceKey, ContainerRef]  # reported devices no allocation holds: adopted
    # Not judged, but may merge with a judged or adopted allocation of the same container.
    others: tuple[Allocation, ...] = ()


def full_scope(
    allocations: Iterable[Allocation], reported: Mapping[DeviceKey, ContainerRef]
) -> ReconcileScope:
    """Every allocation judged, every reported device no allocation holds adopted."""
    judged = tuple(allocations)
    held = {key for allocation in judged for key in allocation.device_pairs()}
    return ReconcileScope(judged, {key: ref for key, ref in reported.items() if key not in held})


def plan_reconcile(
    allocations: Iterable[Allocation],
    reported: Mapping[DeviceKey, ContainerRef],
    now: float,
    grace_seconds: float,
    memory_unit_mib: int,
    new_id: Callable[[], str],
    id_hints: Mapping[ContainerRef, str] | None = None,
) -> ReconcilePlan:
    """What to change so that the ledger says what kubelet says. ``reported``: each device
    kubelet reports -> its container; ``id_hints``: container -> its registered ID."""
    scope = full_scope(allocations, reported)
    live_ids = {allocation.id for allocation in scope.judged}
    return _plan(
        scope, reported, now, grace_seconds, memory_unit_mib, new_id, id_hints or {}, live_ids
    )


def plan_scoped(
    scope: ReconcileScope,
    reported: Mapping[DeviceKey, ContainerRef],
    now: float,
    grace_seconds: float,
    memory_unit_mib: int,
    new_id: Callable[[], str],
) -> ReconcilePlan:
    """``plan_reconcile``'s plan, made from ``scope`` alone (no ID hints: those need
    every live ID, so a reconcile with hints is a full walk)."""
    return _plan(scope, reported, now, grace_seconds, memory_unit_mib, new_id, {}, set())


def _plan(
    scope: ReconcileScope,
    reported: Mapping[DeviceKey, ContainerRef],
    now: float,
    grace_seconds: float,
    memory_unit_mib: int,
    new_id: Callable[[], str],
    id_hints: Mapping[ContainerRef, str],
    live_ids: set[str],
) -> ReconcilePlan:
    plan = ReconcilePlan()
    for allocation in scope.judged:
        _reconcile_one(allocation, reported, now, grace_seconds, memory_unit_mib, new_id, plan)
    adoptions = [
        (ref, adopted)
        for ref, devices in sorted(_group_by_container(scope.unheld).items())
        for adopted in _allocations_for(devices, ref, now, memory_unit_mib, new_id)
    ]
    taken = live_ids | {a.id for a in plan.put}
    for ref, adopted in _with_hinted_ids(adoptions, id_hints, taken):
        plan.put.append(adopted)
        plan.notes.append(
            f"adopted {_describe_devices(adopted)} that kubelet reports for {ref} "
            f"as allocation {adopted.id}: the ledger did not hold them"
        )
    _merge_per_container_and_card((*scope.judged, *scope.others), reported, memory_unit_mib, plan)
    return plan


def _merge_per_container_and_card(
    before: Iterable[Allocation],
    reported: Mapping[DeviceKey, ContainerRef],
    memory_unit_mib: int,
    plan: ReconcilePlan,
) -> None:
    """One allocation per container and card: kubelet says one container holds them all
    (its second resource's Allocate made one of its own, e.g. retried after a timeout),
    so they are one quota."""
    after = {a.id: a for a in before if a.id not in plan.delete}
    after.update({a.id: a for a in plan.put})
    groups: dict[tuple[ContainerRef, str], list[Allocation]] = defaultdict(list)
    for allocation in after.values():
        owners = {reported.get(key) for key in allocation.device_pairs()}
        owner = owners.pop() if len(owners) == 1 else None
        if allocation.whole or owner is None:
            continue
        groups[(owner, allocation.cards[0])].append(allocation)
    existing = {a.id for a in before}
    for (ref, card), group in sorted(groups.items()):
        if len(group) < 2:
            continue
        group.sort(key=lambda a: (ResourceKind.MEMORY not in a.devices, a.created_at, a.id))
        uids = sorted({a.owner_uid for a in group if a.owner_uid})
        if len(uids) > 1:
            # Two pods of one name in a record read before kubelet let the old one go: two
            # quotas, never one; the old one's goes once kubelet no longer reports it.
            plan.notes.append(
                f"not merged: allocations {', '.join(a.id for a in group)}, which kubelet "
                f"reports for {ref} on {card}, were made for pods of that name with different "
                f"UIDs ({', '.join(uids)}): a pod deleted and created again under its name"
            )
            continue
        keeper, merged_away = group[0], group[1:]
        devices: dict[ResourceKind, set[str]] = defaultdict(set)
        for allocation in group:
            for kind, device_id in allocation.device_pairs():
                devices[kind].add(device_id)
        merged = replace(keeper, devices={k: tuple(sorted(v)) for k, v in devices.items()})
        merged = replace(
            merged,
            memory_mib=merged.memory_units * memory_unit_mib,
            owner_uid=uids[0] if uids else None,
        )
        gone = {a.id for a in merged_away}
        plan.put = [a for a in plan.put if a.id not in gone and a.id != keeper.id] + [merged]
        plan.delete += sorted(i for i in gone if i in existing)
        plan.notes.append(
            f"merged allocation(s) {', '.join(sorted(gone))} into {keeper.id}: kubelet gives "
            f"all of them to {ref} on {card} ({_describe_devices(merged)})"
        )


def _reconcile_one(
    allocation: Allocation,
    reported: Mapping[DeviceKey, ContainerRef],
    now: float,
    grace_seconds: float,
    memory_unit_mib: int,
    new_id: Callable[[], str],
    plan: ReconcilePlan,
) -> None:
    mine = {key: reported[key] for key in allocation.device_pairs() if key in reported}
    who = f"allocation {allocation.id}" + (f" ({allocation.owner})" if allocation.owner else "")
    if not mine:
        if allocation.confirmed_at is not None:
            plan.delete.append(allocation.id)
            plan.notes.append(f"released {who}: kubelet no longer reports its devices")
        elif now - allocation.created_at > grace_seconds:
            plan.delete.append(allocation.id)
            plan.notes.append(
                f"released {who}: kubelet never reported it within {grace_seconds:g} s "
                "(the pod was refused or deleted during admission)"
            )
        return
    groups = _group_by_container(mine)
    # The container holding the memory keeps the allocation ID (its env has it).
    owners = sorted(groups, key=lambda ref: (ResourceKind.MEMORY not in groups[ref], ref))
    first = owners[0]
    kept = replace(
        allocation,
        devices={kind: tuple(sorted(ids)) for kind, ids in groups[first].items()},
        owner=first,
        confirmed_at=allocation.confirmed_at or now,
        owner_uid=_uid_for(allocation, first),
    )
    kept = replace(kept, memory_mib=kept.memory_units * memory_unit_mib)
    if kept != allocation:
        plan.put.append(kept)
        if allocation.owner != first:
            plan.notes.append(f"allocation {allocation.id} belongs to {first} (kubelet's record)")
        if kept.devices != allocation.devices:
            plan.notes.append(
                f"allocation {allocation.id} now holds {_describe_devices(kept)} "
                f"as kubelet's record says (was {_describe_devices(allocation)})"
            )
    for ref in owners[1:]:
        for split in _allocations_for(groups[ref], ref, now, memory_unit_mib, new_id):
            split = replace(split, owner_uid=_uid_for(allocation, ref))
            plan.put.append(split)
            plan.notes.append(
                f"split {_describe_devices(split)} of allocation {allocation.id} off to {ref} "
                f"as allocation {split.id}: kubelet gave them to another container"
            )


def _uid_for(allocation: Allocation, ref: ContainerRef) -> str | None:
    """The allocation's own UID where ``ref`` is of the pod it was made for (kubelet gives
    a pod's devices to no other pod of its name), else unknown (the pod cache guessed
    wrong)."""
    owner = allocation.owner
    if owner is None or (owner.namespace, owner.pod) != (ref.namespace, ref.pod):
        return None
    return allocation.owner_uid


def _with_hinted_ids(
    adoptions: list[tuple[ContainerRef, Allocation]],
    id_hints: Mapping[ContainerRef, str],
    taken: set[str],
) -> list[tuple[ContainerRef, Allocation]]:
    """Adoptions with their container's (else pod's) old ID where unambiguous."""
    per_pod: dict[tuple[str, str], int] = defaultdict(int)
    for ref, _adopted in adoptions:
        per_pod[(ref.namespace, ref.pod)] += 1
    pod_hints: dict[tuple[str, str], set[str]] = defaultdict(set)
    for ref, old_id in id_hints.items():
        pod_hints[(ref.namespace, ref.pod)].add(old_id)
    result = []
    for ref, adopted in adoptions:
        pod = (ref.namespace, ref.pod)
        hinted = id_hints.get(ref)
        if hinted is None and per_pod[pod] == 1 and len(pod_hints[pod]) == 1:
            hinted = next(iter(pod_hints[pod]))
        if hinted is not None and per_pod[pod] == 1 and hinted not in taken:
            taken.add(hinted)
            adopted = replace(adopted, id=hinted)
        result.append((ref, adopted))
    return result


def _group_by_container(
    reported: Mapping[DeviceKey, ContainerRef],
) -> dict[ContainerRef, dict[ResourceKind, list[str]]]:
    groups: dict[ContainerRef, dict[ResourceKind, list[str]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for (kind, device_id), ref in reported.items():
        groups[ref][kind].append(device_id)
    return groups


def _allocations_for(
    devices: Mapping[ResourceKind, list[str]],
    ref: ContainerRef,
    now: float,
    memory_unit_mib: int,
    new_id: Callable[[], str],
) -> list[Allocation]:
    per_card: dict[str, dict[ResourceKind, list[str]]] = defaultdict(lambda: defaultdict(list))
    whole: dict[ResourceKind, list[str]] = {}
    for kind, ids in devices.items():
        if kind is ResourceKind.WHOLE:
            whole[kind] = list(ids)
            continue
        for device_id in ids:
            per_card[card_of(kind, device_id) or device_id][kind].append(device_id)
    made = []
    for group in ([whole] if whole else []) + [per_card[card] for card in sorted(per_card)]:
        sorted_group = {kind: tuple(sorted(ids)) for kind, ids in group.items()}
        units = len(sorted_group.get(ResourceKind.MEMORY, ()))
        made.append(
            Allocation(
                id=new_id(),
                devices=sorted_group,
                memory_mib=units * memory_unit_mib,
                created_at=now,
                owner=ref,
                confirmed_at=now,
            )
        )
    return made


def _describe_devices(allocation: Allocation) -> str:
    parts = []
    if allocation.memory_units:
        parts.append(f"{allocation.memory_units} memory units")
    if allocation.core_percent:
        parts.append(f"{allocation.core_percent}% share")
    if allocation.whole:
        parts.append(f"whole card(s) {','.join(allocation.devices[ResourceKind.WHOLE])}")
    cards = "" if allocation.whole else f" on {','.join(allocation.cards)}"
    return " + ".join(parts) + cards
