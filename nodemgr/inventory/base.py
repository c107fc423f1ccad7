"""The inventory interface and its plain data (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Card:
    """One GPU as the node sees it. Unknown facts are None, never guessed."""

    index: int  # NVML index (order of enumeration), shown to admins as GPU<index>
    uuid: str  # stable across reboots; device IDs are built from it
    name: str  # model, e.g. "Tesla T4"
    memory_mib: int  # total memory
    compute_capability: str | None = None  # "7.5"
    minor_number: int | None = None  # /dev/nvidia<minor>
    numa_node: int | None = None  # for kubelet's topology manager
    mig_enabled: bool | None = None  # MIG cards are not shared by gpushare-node


@dataclass(frozen=True)
class ProcessUsage:
    """GPU memory one process holds on one card."""

    pid: int
    gpu_uuid: str
    used_mib: int


# Compute modes gpushare-node sets: MPS cards run EXCLUSIVE_PROCESS so that the
# MPS server is the only context (a process bypassing MPS fails instead of
# escaping its limits); cards given out whole go back to DEFAULT.
COMPUTE_MODES = ("DEFAULT", "EXCLUSIVE_PROCESS")


class Inventory(Protocol):
    """What the daemon needs from the GPUs."""

    def cards(self) -> tuple[Card, ...]:
        """The node's cards, by index. Raises InventoryError when they cannot be read."""
        ...

    def process_usage(self) -> list[ProcessUsage]:
        """Current per-process GPU memory on every card."""
        ...

    def set_compute_mode(self, card_uuid: str, mode: str) -> None:
        """Set a card's compute mode (one of COMPUTE_MODES); InventoryError if refused."""
        ...

    def close(self) -> None: ...
