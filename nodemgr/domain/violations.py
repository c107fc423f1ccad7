"""Which GPU processes break their container's quota, and which to kill (pure).

Input is one snapshot: the registered containers, the live allocations, and
every GPU process with its cgroups and quota env (None where /proc could not
be read: the process is gone). Output is the list of violations; each names
the processes that ``action: kill`` would stop, newest first, just enough to
bring the container back within its quota.

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

MEMORY = "memory"  # a container's GPU processes together use more than its memory quota
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
    by_container: dict[str, list[GpuProcess]] = {}
    violations = []
    index = index_registrations(registrations)
    for process in processes:
        registration = registration_of(index, process.cgroups)
        allocation = allocations.get(registration.allocation_id) if registration else None
        if registration is None or allocation is None or process.card_uuid not in allocation.cards:
            if process.card_uuid in shared_cards:
                violations.append(_unallocated(process, registration, allocation))
            continue
        by_container.setdefault(registration.container_id, []).append(process)
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
    for registration in registrations:
        allocation = allocations.get(registration.allocation_id)
        held = by_container.get(registration.container_id)
        if not held or allocation is None or allocation.whole or not allocation.memory_units:
            continue
        violation = _over_memory(registration, allocation, held, grace_mib)
        if violation:
            violations.append(violation)
    return violations


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
    registration: Registration, allocation: Allocation, held: list[GpuProcess], grace_mib: int
) -> Violation | None:
    used_mib = sum(p.used_mib for p in held)
    allowed_mib = allocation.memory_mib + grace_mib
    if used_mib <= allowed_mib:
        return None
    to_kill, remaining_mib = [], used_mib
    for process in sorted(held, key=lambda p: (p.start_ticks, p.pid), reverse=True):
        if remaining_mib <= allowed_mib:
            break
        to_kill.append(process.pid)
        remaining_mib -= process.used_mib
    return Violation(
        kind=MEMORY,
        card_uuid=held[0].card_uuid,
        pids=tuple(to_kill),
        detail=(
            f"{len(held)} GPU process(es) use {used_mib} MiB together, over the quota of "
            f"{allocation.memory_mib} MiB (+{grace_mib} MiB grace)"
        ),
        allocation_id=allocation.id,
        container_id=registration.container_id,
        owner=allocation.owner or registration.identity,
        used_mib=used_mib,
        quota_mib=allocation.memory_mib,
        key=(MEMORY, registration.container_id),
    )


def _unallocated(
    process: GpuProcess, registration: Registration | None, allocation: Allocation | None
) -> Violation:
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
