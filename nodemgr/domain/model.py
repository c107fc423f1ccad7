"""The allocation record shared by the ledger, the allocator and reconcile (pure data).

An ``Allocation`` is what one container holds: shared (memory and/or share devices,
all on ONE card) or whole cards. Its device IDs are kubelet's own, so kubelet's record
and the ledger compare ID by ID.

One made for a DRA ResourceClaim (docs/dra.md) holds device IDs the node chose from the
card's free ones and carries its ``claim``: kubelet's device plugin side never hands
those IDs out (listed Unhealthy), and reconcile leaves it alone (NodeUnprepareResources
releases it).

An owner is a name, as kubelet's record gives it; a pod created again under its name is
told apart by its UID where known (``Allocation.held_by``).
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
    """One allocation result of a claim this node prepared (request as the scheduler wrote
    it, ``main`` or ``main/sub``; share ID None for a device given whole)."""

    request: str
    pool: str
    device: str
    share_id: str | None = None


@dataclass(frozen=True)
class ClaimRef:
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
    # units x memory_unit_mib at allocation time: the limit in the container's env.
    memory_mib: int
    created_at: float  # Unix seconds
    owner: ContainerRef | None = None  # filled in from kubelet's PodResources record
    confirmed_at: float | None = None  # last time kubelet's record showed it
    claim: ClaimRef | None = None
    # The pod the pod cache matched at Allocate (kubelet's record names pods, never UIDs):
    # tells a pod recreated under the same name from the one that held this allocation.
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
        """Sorted card UUIDs (cached: an Allocation is never changed in place)."""
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
        """Whether this allocation may be that pod's: same owner name, and same owner UID
        where known."""
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
    """One cgroup hierarchy (a /proc/PID/cgroup controller list: "" for v2, "memory" for
    v1) and a path in it."""

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
