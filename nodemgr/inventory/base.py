"""The inventory interface and its plain data (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Card:
    """One GPU as the node sees it. Unknown facts are None, never guessed."""

    index: int  # NVML's enumeration order, shown as GPU<index>
    uuid: str  # stable across reboots; device IDs are built from it
    name: str  # model, e.g. "Tesla T4"
    memory_mib: int
    compute_capability: str | None = None  # "7.5"
    minor_number: int | None = None  # /dev/nvidia<minor>
    numa_node: int | None = None  # for kubelet's topology manager
    mig_enabled: bool | None = None  # MIG cards are not shared by gpushare-node


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    gpu_uuid: str
    used_mib: int


# MPS cards run EXCLUSIVE_PROCESS so the MPS server is the only context (a process
# bypassing MPS fails instead of escaping its limits); whole cards run DEFAULT.
COMPUTE_MODES = ("DEFAULT", "EXCLUSIVE_PROCESS")


class Inventory(Protocol):
    def cards(self) -> tuple[Card, ...]:
        """By index; InventoryError when they cannot be read."""
        ...

    def process_usage(self) -> list[ProcessUsage]: ...

    def set_compute_mode(self, card_uuid: str, mode: str) -> None:
        """InventoryError if refused."""
        ...

    def close(self) -> None: ...
