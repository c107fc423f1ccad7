"""The allocation record shared by the ledger, the allocator and reconcile (pure data).

One ``Allocation`` is what one container holds on this node: either a shared
allocation (memory and/or compute share devices, all on ONE card) or a
whole-card allocation (one or more whole cards). Its device IDs are kubelet's
own IDs, so kubelet's record and the ledger can be compared ID by ID.

An allocation made for a DRA ResourceClaim (the second front door, docs/dra.md)
holds device IDs the same way, chosen by the node from the card's free ones, and
carries its ``claim`` (``ClaimRef``): the device plugin's kubelet never hands out
those IDs (they are listed Unhealthy), and reconcile with the device plugin's
record leaves it alone (kubelet's NodeUnprepareResources releases it).

An owner is a name (namespace/pod/container), as kubelet's record gives it; a pod
deleted and created again under its name is another pod, told apart by its UID
(``owner_uid``, known where the pod cache matched the pod at Allocate): see
``Allocation.held_by``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from hooks.textsafe import quote
from nodemgr.domain.deviceids import ResourceKind, card_of


@dataclass(frozen=True, order=True)
class ContainerRef:
    """Which container kubelet says holds devices."""

    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return "/".join(quote(part) for part in (self.namespace, self.pod, self.container))


@dataclass(frozen=True)
class ClaimResult:
    """One allocation result of a ResourceClaim that this node prepared: the request
    it serves (as the scheduler wrote it, ``main`` or ``main/sub``), the pool and
    device (the card) and the share ID (None for a device given whole)."""

    request: str
    pool: str
    device: str
    share_id: str | None = None


@dataclass(frozen=True)
class ClaimRef:
    """The ResourceClaim an allocation was made for, and its results on this node."""

    uid: str
    namespace: str
    name: str
    results: tuple[ClaimResult, ...]

    def __str__(self) -> str:
        return f"claim {self.namespace}/{self.name}"


@dataclass(frozen=True)
class Allocation:
    id: str
    # Device IDs per resource kind; a shared allocation has MEMORY and/or CORE,
    # a whole one has WHOLE. Tuples are kept sorted.
    devices: dict[ResourceKind, tuple[str, ...]]
    # Memory in MiB at allocation time (units x memory_unit_mib), the limit
    # written into the container's env.
    memory_mib: int
    created_at: float  # Unix seconds
    owner: ContainerRef | None = None  # filled in from kubelet's PodResources record
    confirmed_at: float | None = None  # last time kubelet's record showed it
    claim: ClaimRef | None = None  # made by NodePrepareResources for this claim (DRA)
    # The UID of the owner's pod, when known: the pod the Kubernetes pod cache matched at
    # Allocate (kubelet's record names pods, never UIDs). It tells a pod recreated under
    # the same name (a StatefulSet's web-0) from the one that held this allocation.
    owner_uid: str | None = None

    @property
    def whole(self) -> bool:
        return ResourceKind.WHOLE in self.devices

    @property
    def core_percent(self) -> int:
        return len(self.devices.get(ResourceKind.CORE, ()))

    @property
    def memory_units(self) -> int:
        return len(self.devices.get(ResourceKind.MEMORY, ()))

    @functools.cached_property
    def cards(self) -> tuple[str, ...]:
        """UUIDs of the cards it holds, sorted (one for a shared allocation). Computed once:
        an Allocation is never changed in place (``replace`` makes a new one), and this is
        read for every allocation at every publish and status document."""
        return tuple(
            sorted(
                {
                    card_of(kind, device_id) or device_id
                    for kind, ids in self.devices.items()
                    for device_id in ids
                }
            )
        )

    def held_by(self, namespace: str, pod: str, uid: str) -> bool:
        """Whether this allocation may be the pod ``namespace/pod`` with UID ``uid``'s: its
        owner has that name and its owner UID, where known, is that one. An allocation
        whose owner UID is unknown may be any pod of that name."""
        owner = self.owner
        if owner is None or (owner.namespace, owner.pod) != (namespace, pod):
            return False
        return not self.owner_uid or not uid or self.owner_uid == uid

    def device_pairs(self) -> list[tuple[ResourceKind, str]]:
        return [(kind, device_id) for kind, ids in self.devices.items() for device_id in ids]

    def with_devices(self, kind: ResourceKind, ids: tuple[str, ...] | list[str]) -> Allocation:
        devices = dict(self.devices)
        if ids:
            devices[kind] = tuple(sorted(ids))
        else:
            devices.pop(kind, None)
        return replace(self, devices=devices)


@dataclass(frozen=True)
class Mount:
    """A host path mounted into the container (Allocate's ContainerAllocateResponse.mounts)."""

    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class CgroupKey:
    """Where a container's processes are: one cgroup hierarchy and a path in it.

    ``hierarchy`` is the controller list of a /proc/PID/cgroup line ("" for
    the cgroup v2 unified hierarchy, "memory" for a v1 one).
    """

    hierarchy: str
    path: str

    def __str__(self) -> str:
        return f"{self.hierarchy or 'unified'}:{quote(self.path)}"


@dataclass(frozen=True)
class Registration:
    """A container the runtime hook let start, and the allocation it uses."""

    container_id: str
    allocation_id: str
    cgroup: CgroupKey
    init_pid: int
    init_start_ticks: int  # /proc/PID/stat starttime: tells a reused PID apart
    identity: ContainerRef | None
    registered_at: float  # Unix seconds
