"""The narrow interface between the kubelet device plugin servers and the allocation state.

The shape of NVIDIA's device plugin ``rm.ResourceManager``: a server needs a
resource's device list and its changes, a preferred pick, an allocation and a
pre-start check, and nothing more. :class:`~nodemgr.allocation.allocator.Allocator`
implements it; a test can hand a server any object of this shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from nodemgr.common.changes import ChangeCounter
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Mount


@dataclass(frozen=True)
class DeviceInfo:
    id: str
    healthy: bool
    numa_node: int | None


@dataclass(frozen=True)
class AllocateResult:
    allocation_id: str
    envs: dict[str, str]
    mounts: tuple[Mount, ...] = ()


class ResourceManager(Protocol):
    """What one device plugin server asks of the allocation state.

    Every call raises only :class:`~nodemgr.errors.GpushareError` subclasses for
    refusals (the server maps them to gRPC codes) and must not block on anything
    slower than the local ledger.
    """

    @property
    def resource_names(self) -> Mapping[ResourceKind, str]:
        """The extended resource name of each kind this node offers."""
        ...

    @property
    def device_changes(self) -> ChangeCounter:
        """Moves whenever a device list may have changed (a card's health, a card given
        out whole or taking shared work); not on ordinary admissions."""
        ...

    def devices(self, kind: ResourceKind) -> list[DeviceInfo]:
        """The full device list of one resource, with health."""
        ...

    def preferred(
        self, kind: ResourceKind, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        """GetPreferredAllocation: the IDs kubelet should pick."""
        ...

    def allocate(self, kind: ResourceKind, device_ids: Sequence[str]) -> AllocateResult:
        """Allocate: record the container's devices durably; its env and mounts."""
        ...

    def check_known(self, kind: ResourceKind, device_ids: Sequence[str]) -> None:
        """PreStartContainer: the IDs must be this node's."""
        ...
