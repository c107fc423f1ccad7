"""Which GPU processes break their allocation's quota, and which to kill (pure).

Input is one snapshot: registered containers, live allocations, every GPU process with
its cgroups and quota env. Each violation names the processes ``action: kill`` stops,
newest first, just enough to get back within the quota.

The memory quota is the allocation's, not a container's: every process of every
container on the allocation (one pod, :mod:`nodemgr.domain.podtie`) counts toward one
sum, else containers sharing one allocation id would each get the whole quota.

A process holding a card's MPS control daemon (:class:`ControlHold`) is an MPS_CONTROL
violation. Only a process in a container is acted on: one registered on an allocation,
or one in a mount namespace of its own outside every systemd service's cgroup; a host
process is named, never killed. A container that holds MPS again soon after (a loop
starting a new client after each kill) loses its init process too.

What could not be read fails closed: unreadable cgroups belong to no container (on a
policed card: unallocated), an unreadable environ has no quota env, and a quota value
not in its exact ASCII form is an env violation.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from hooks.gpuenv import quota_env_form_problem
from nodemgr.domain.containercheck import quota_env_problem
from nodemgr.domain.model import Allocation, ContainerRef, Registration
from nodemgr.domain.podtie import shown_pod

MEMORY = "memory"  # an allocation's GPU processes together use more than its memory quota
ENV = "env"  # a GPU process of a registered container lacks or raises its quota env
UNALLOCATED = "unallocated"  # a GPU process on one of the node's cards outside its allocation
MPS_CONTROL = "mps_control"  # a process holds its card's MPS control daemon: hung for all
KINDS = (MEMORY, ENV, UNALLOCATED, MPS_CONTROL)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    card_uuid: str
    used_mib: int
    start_ticks: int
    cgroups: dict[str, str]
    env: dict[str, str]  # the GPU env names of /proc/PID/environ
    cgroup_problem: str | None = None  # why cgroups are unknown (then: no container)
    env_problem: str | None = None


@dataclass(frozen=True)
class ControlHold:
    """A connection on which a card's control daemon waits for a silent client
    (mps.holders): its holders hold MPS on the card for everyone."""

    card_uuid: str
    connection: int  # the daemon's end (socket inode)
    peer: int  # the client's end (socket inode)
    holders: tuple[tuple[int, int], ...]  # (PID, start ticks) of each process holding it


@dataclass(frozen=True)
class HolderProcess:
    pid: int
    start_ticks: int
    cgroups: dict[str, str]
    cgroup_problem: str | None = None
    host_mount_ns: bool | None = None  # in the node daemon's mount namespace


@dataclass(frozen=True)
class Violation:
    kind: str  # one of KINDS
    card_uuid: str
    pids: tuple[int, ...]  # what action "kill" stops, in order
    detail: str  # one sentence with the amounts
    allocation_id: str | None = None
    container_id: str | None = None
    owner: ContainerRef | None = None
    used_mib: int = 0
    quota_mib: int = 0
    # The same while the violation lasts.
    key: tuple[object, ...] = field(default=(), compare=False)


def find_violations(
    registrations: list[Registration],
    allocations: dict[str, Allocation],
    processes: list[GpuProcess],
    cards: set[str],
    grace_mib: int,
    whole_cards: Collection[str] = frozenset(),
) -> list[Violation]:
    """``cards``: the node's cards, all policed, shared or whole (``whole_cards``): a GPU
    process there that no live allocation holding the card explains is unallocated."""
    by_allocation: dict[str, list[tuple[Registration, GpuProcess]]] = {}
    violations = []
    index = index_registrations(registrations)
    for process in processes:
        registration, allocation = _holder(index, allocations, process)
        if registration is None or allocation is None:
            if process.card_uuid in cards:
                whole = process.card_uuid in whole_cards
                violations.append(_unallocated(process, index, allocations, whole))
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
    """Allocation ID -> the MiB its memory check sums (what a status shows as its use)."""
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
    """The registered container and live allocation a process counts toward; the
    allocation must hold the process's card."""
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
    process: GpuProcess,
    index: RegistrationIndex,
    allocations: dict[str, Allocation],
    whole_card: bool,
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
        detail=(
            f"process {process.pid} uses {process.used_mib} MiB of "
            f"{'a card given out whole' if whole_card else 'a shared card'} and {why}"
        ),
        allocation_id=allocation.id if allocation else None,
        container_id=registration.container_id if registration else None,
        owner=(allocation.owner if allocation else None)
        or (registration.identity if registration else None),
        used_mib=process.used_mib,
        key=(UNALLOCATED, process.pid, process.start_ticks),
    )


def control_hold_violation(
    hold: ControlHold,
    holders: list[HolderProcess],
    index: RegistrationIndex,
    allocations: dict[str, Allocation],
    repeat: Collection[str] = (),
) -> Violation:
    """``holders``: those of ``hold``'s processes still running. A registered container in
    ``repeat`` (it held MPS lately already) loses its init process too, so kubelet
    restarts it with back-off."""
    named: list[str] = []
    pids: list[int] = []
    first: tuple[Registration, Allocation | None] | None = None
    for holder in holders:
        registration = registration_of(index, holder.cgroups)
        allocation = allocations.get(registration.allocation_id) if registration else None
        if registration is not None:
            first = first or (registration, allocation)
            owner = (allocation.owner if allocation else None) or registration.identity
            pod = f", pod {shown_pod(owner)}" if owner else ""
            again = ""
            pids.append(holder.pid)
            if registration.container_id in repeat:
                again = (
                    f"; it held MPS lately already: its init process {registration.init_pid} "
                    "too, so the container stops"
                )
                pids.append(registration.init_pid)
            named.append(
                f"process {holder.pid} (container {registration.container_id}{pod}{again})"
            )
        elif holder.host_mount_ns is False and not _in_a_service(holder.cgroups):
            named.append(
                f"process {holder.pid} (in a container of no registered allocation: "
                "a mount namespace of its own)"
            )
            pids.append(holder.pid)
        else:
            named.append(
                f"process {holder.pid} (in no container: a process of the host's, named "
                "and not killed)"
            )
    registration, allocation = first if first is not None else (None, None)
    return Violation(
        kind=MPS_CONTROL,
        card_uuid=hold.card_uuid,
        pids=tuple(dict.fromkeys(pids)),
        detail=(
            f"{', '.join(named) or 'no process any more'} holds a connection to the card's MPS "
            "control socket and sends nothing, or reads nothing of what the control daemon "
            "sends it: the daemon, which serves one client at a time, waits on it, so MPS "
            "on the card answers no tenant"
        ),
        allocation_id=registration.allocation_id if registration else None,
        container_id=registration.container_id if registration else None,
        owner=(allocation.owner if allocation else None)
        or (registration.identity if registration else None),
        key=(MPS_CONTROL, hold.card_uuid, hold.connection, hold.peer),
    )


def _in_a_service(cgroups: dict[str, str]) -> bool:
    """A host service may have a mount namespace of its own (PrivateTmp=); a container
    never runs in a systemd service's cgroup."""
    return any(part.endswith(".service") for path in cgroups.values() for part in path.split("/"))
