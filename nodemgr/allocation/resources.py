"""The narrow interface between the kubelet device plugin servers and the allocation state.

The shape of NVIDIA's device plugin ``rm.ResourceManager``: a server needs nothing more.
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
    """Refusals raise only :class:`~nodemgr.errors.GpushareError` subclasses; no call
    blocks on anything slower than the local ledger."""

    @property
    def resource_names(self) -> Mapping[ResourceKind, str]: ...

    @property
    def device_changes(self) -> ChangeCounter:
        """Moves when a device list may have changed; not on ordinary admissions."""
        ...

    def devices(self, kind: ResourceKind) -> list[DeviceInfo]: ...

    def preferred(
        self, kind: ResourceKind, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        """GetPreferredAllocation."""
        ...

    def allocate(self, kind: ResourceKind, device_ids: Sequence[str]) -> AllocateResult:
        """Allocate: recorded durably before the answer."""
        ...

    def check_known(self, kind: ResourceKind, device_ids: Sequence[str]) -> None:
        """PreStartContainer."""
        ...
