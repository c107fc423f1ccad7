"""GPU inventory: which cards this node has, and what processes use on them.

``driverversion`` reads the loaded NVIDIA module's version (doctor, the DRA slice).
One narrow interface (``Inventory`` in base.py) with two backends: NVML
(``nvml.py``, the only module of the project that imports pynvml) and
simulated. Cards are described one by one, never assumed equal.

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
