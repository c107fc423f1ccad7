"""Which GPU processes break their allocation's quota, and which to kill (pure).

Input is one snapshot: the registered containers, the live allocations, and
every GPU process with its cgroups and quota env (None where /proc could not
be read: the process is gone). Output is the list of violations; each names
the processes that ``action: kill`` would stop, newest first, just enough to
bring the allocation back within its quota.

The memory quota is the allocation's, not a container's: every process of
every container registered on the allocation (all of one pod, see
:mod:`nodemgr.domain.podtie`) on its card counts toward one sum, else three
containers sharing one allocation id would each get the whole quota.

What could not be read fails closed: a process whose cgroups could not be
read belongs to no container (on a shared card it is unallocated), one whose
environ could not be read has no quota env (an env violation), and a quota
value not in its exact ASCII form is an env violation naming the variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hooks.gpuenv import quota_env_form_problem
from nodemgr.domain.containercheck import quota_env_problem
from nodemgr.domain.model import Allocation, ContainerRef, Registration
from nodemgr.domain.podtie import shown_pod

MEMORY = "memory"  # an allocation's GPU processes together use more than its memory quota
ENV = "env"  # a GPU process of a registered container lacks or raises its quota env
UNALLOCATED = "unallocated"  # a GPU process on a shared card outside any allocation


@dataclass(frozen=True)
class GpuProcess:
    """A process holding GPU memory, as the inventory and /proc see it."""

    pid: int
    card_uuid: str
    used_mib: int
    start_ticks: int
    cgroups: dict[str, str]
    env: dict[str, str]  # the GPU env names of /proc/PID/environ
    # Why /proc/PID/cgroup could not be read (then ``cgroups`` is empty: no container).
    cgroup_problem: str | None = None
    # Why /proc/PID/environ could not be read (then its quota env counts as missing).
    env_problem: str | None = None


@dataclass(frozen=True)
class Violation:
    kind: str  # MEMORY, ENV or UNALLOCATED
    card_uuid: str
    pids: tuple[int, ...]  # what action "kill" stops, in order
    detail: str  # one sentence with the amounts
    allocation_id: str | None = None
    container_id: str | None = None
    owner: ContainerRef | None = None
    used_mib: int = 0
    quota_mib: int = 0
    # (kind, allocation or pid...) that stays the same while the violation lasts
    key: tuple[object, ...] = field(default=(), compare=False)


def find_violations(
    registrations: list[Registration],
    allocations: dict[str, Allocation],
    processes: list[GpuProcess],
    shared_cards: set[str],
    grace_mib: int,
) -> list[Violation]:
    by_allocation: dict[str, list[tuple[Registration, GpuProcess]]] = {}
    violations = []
    index = index_registrations(registrations)
    for process in processes:
        registration, allocation = _holder(index, allocations, process)
        if registration is None or allocation is None:
            if process.card_uuid in shared_cards:
                violations.append(_unallocated(process, index, allocations))
            continue
        by_allocation.setdefault(allocation.id, []).append((registration, process))
        if allocation.whole:
            continue
        problem = _env_problem(process, allocation)
        if problem:
            violations.append(
                Violation(
                    kind=ENV,
                    card_uuid=process.card_uuid,
                    pids=(process.pid,),
                    detail=f"process {process.pid} runs on the GPU outside its quota: {problem}",
                    allocation_id=allocation.id,
                    container_id=registration.container_id,
                    owner=allocation.owner or registration.identity,
                    used_mib=process.used_mib,
                    quota_mib=allocation.memory_mib,
                    key=(ENV, process.pid, process.start_ticks),
                )
            )
    for allocation_id, held in by_allocation.items():
        allocation = allocations[allocation_id]
        if allocation.whole or not allocation.memory_units:
            continue
        violation = _over_memory(allocation, held, grace_mib)
        if violation:
            violations.append(violation)
    return violations


def allocation_used_mib(
    registrations: list[Registration],
    allocations: dict[str, Allocation],
    processes: list[GpuProcess],
) -> dict[str, int]:
    """Allocation ID -> the MiB its memory check sums: every process of every container
    registered on it, on the allocation's own cards (what a status shows as its use)."""
    used: dict[str, int] = {}
    index = index_registrations(registrations)
    for process in processes:
        _, allocation = _holder(index, allocations, process)
        if allocation is not None:
            used[allocation.id] = used.get(allocation.id, 0) + process.used_mib
    return used


def _holder(
    index: RegistrationIndex, allocations: dict[str, Allocation], process: GpuProcess
) -> tuple[Registration, Allocation] | tuple[None, None]:
    """The registered container and live allocation a process counts toward, if any: the
    allocation must hold the process's card (elsewhere it uses a card nobody gave it)."""
    registration = registration_of(index, process.cgroups)
    allocation = allocations.get(registration.allocation_id) if registration else None
    if registration is None or allocation is None or process.card_uuid not in allocation.cards:
        return None, None
    return registration, allocation


def _env_problem(process: GpuProcess, allocation: Allocation) -> str | None:
    if process.env_problem is not None:
        return f"its environ cannot be read ({process.env_problem}), so neither its quota env"
    if allocation.memory_units or allocation.core_percent:
        # The exact form first: float() and friends read other scripts' digits.
        problem = quota_env_form_problem(process.env)
        if problem is not None:
            return problem
    return quota_env_problem(process.env, allocation)


RegistrationIndex = dict[str, dict[str, Registration]]  # hierarchy -> cgroup path -> container


def index_registrations(registrations: list[Registration]) -> RegistrationIndex:
    index: RegistrationIndex = {}
    for registration in registrations:
        index.setdefault(registration.cgroup.hierarchy, {})[registration.cgroup.path] = registration
    return index


def registration_of(index: RegistrationIndex, cgroups: dict[str, str]) -> Registration | None:
    """The registered container whose cgroup holds these cgroups (itself or an ancestor)."""
    for hierarchy, by_path in index.items():
        path = cgroups.get(hierarchy)
        while path:
            if path in by_path:
                return by_path[path]
            path = path.rpartition("/")[0]
    return None


def _over_memory(
    allocation: Allocation, held: list[tuple[Registration, GpuProcess]], grace_mib: int
) -> Violation | None:
    """The allocation's processes, in all its containers together, over quota + grace:
    the newest across the allocation, just enough to get back within it."""
    used_mib = sum(process.used_mib for _, process in held)
    allowed_mib = allocation.memory_mib + grace_mib
    if used_mib <= allowed_mib:
        return None
    newest_first = sorted(held, key=lambda rp: (rp[1].start_ticks, rp[1].pid), reverse=True)
    to_kill, remaining_mib = [], used_mib
    for _, process in newest_first:
        if remaining_mib <= allowed_mib:
            break
        to_kill.append(process.pid)
        remaining_mib -= process.used_mib
    # Named for the pod: kubelet's owner, else an identity the hook registered.
    owner = allocation.owner or next((r.identity for r, _ in newest_first if r.identity), None)
    containers = sorted({registration.container_id for registration, _ in held})
    return Violation(
        kind=MEMORY,
        card_uuid=newest_first[0][1].card_uuid,
        pids=tuple(to_kill),
        detail=(
            f"{len(held)} GPU process(es) of allocation {allocation.id} (pod "
            f"{shown_pod(owner) if owner else 'unknown'}, container(s) {', '.join(containers)}) "
            f"use {used_mib} MiB together, over the quota of {allocation.memory_mib} MiB "
            f"(+{grace_mib} MiB grace)"
        ),
        allocation_id=allocation.id,
        container_id=newest_first[0][0].container_id,  # the first killed is its process
        owner=owner,
        used_mib=used_mib,
        quota_mib=allocation.memory_mib,
        key=(MEMORY, allocation.id),
    )


def _unallocated(
    process: GpuProcess, index: RegistrationIndex, allocations: dict[str, Allocation]
) -> Violation:
    registration = registration_of(index, process.cgroups)
    allocation = allocations.get(registration.allocation_id) if registration else None
    if process.cgroup_problem is not None:
        why = f"cannot be tied to any container: {process.cgroup_problem}"
    elif registration is None:
        why = "belongs to no registered container"
    elif allocation is None:
        why = (
            f"belongs to container {registration.container_id}, whose allocation "
            f"{registration.allocation_id} was released"
        )
    else:
        why = (
            f"belongs to container {registration.container_id}, whose allocation "
            f"{allocation.id} holds {', '.join(allocation.cards)}, not this card"
        )
    return Violation(
        kind=UNALLOCATED,
        card_uuid=process.card_uuid,
        pids=(process.pid,),
        detail=f"process {process.pid} uses {process.used_mib} MiB of a shared card and {why}",
        allocation_id=allocation.id if allocation else None,
        container_id=registration.container_id if registration else None,
        owner=(allocation.owner if allocation else None)
        or (registration.identity if registration else None),
        used_mib=process.used_mib,
        key=(UNALLOCATED, process.pid, process.start_ticks),
    )
