"""GPU inventory: which cards this node has, and what processes use on them.

- ``base``: the one narrow interface (``Inventory``) and its plain data;
- ``nvml``: the NVML backend, the only module of the project that imports pynvml;
- ``simulated``: cards from the config, per-process usage from a JSON file;
- ``driverversion``: the loaded NVIDIA module's version (doctor, the DRA slice).
Cards of different models and sizes are described one by one, never assumed
equal.

What it must not do: decide anything about allocations; hold a lock or do
slow work when asked for the card list (the allocator asks it at start-up).
"""

from nodemgr.config.schema import GpuSettings
from nodemgr.inventory.base import Card, Inventory, ProcessUsage


def open_inventory(settings: GpuSettings) -> Inventory:
    """The backend the config names; raises InventoryError with a hint on failure."""
    if settings.backend == "simulated":
        from nodemgr.inventory.simulated import SimulatedInventory

        return SimulatedInventory(settings.simulated)
    from nodemgr.inventory.nvml import NvmlInventory

    return NvmlInventory()


__all__ = ["Card", "Inventory", "ProcessUsage", "open_inventory"]
