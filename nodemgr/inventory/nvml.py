"""The NVML backend: the only module of gpushare-node that imports pynvml.

NVML errors are translated here, with the likely cause and the fix; a fact a
card does not support (NUMA node on some boards, MIG on older cards) is None
in the data, not an error.
"""

from __future__ import annotations

import pynvml

from nodemgr.errors import InventoryError
from nodemgr.inventory.base import Card, ProcessUsage

_NO_DRIVER_HINT = (
    "is the NVIDIA driver installed and loaded (nvidia-smi works)? "
    "On a machine without GPUs, set gpus.backend: simulated"
)


class NvmlInventory:
    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as e:
            raise InventoryError(
                f"NVML library (libnvidia-ml.so.1) not found: {_NO_DRIVER_HINT}"
            ) from e
        except pynvml.NVMLError_DriverNotLoaded as e:
            raise InventoryError(f"NVIDIA kernel driver not loaded: {_NO_DRIVER_HINT}") from e
        except pynvml.NVMLError_NoPermission as e:
            raise InventoryError("no permission to use NVML: run gpushare-node as root") from e
        except pynvml.NVMLError as e:
            raise InventoryError(f"NVML failed to initialise: {e}: {_NO_DRIVER_HINT}") from e
        self._cards: tuple[Card, ...] | None = None

    def cards(self) -> tuple[Card, ...]:
        if self._cards is None:
            try:
                count = pynvml.nvmlDeviceGetCount()
                self._cards = tuple(self._card(i) for i in range(count))
            except pynvml.NVMLError as e:
                raise InventoryError(f"NVML could not list the GPUs: {e}") from e
        return self._cards

    def _card(self, index: int) -> Card:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        major_minor = _optional(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
        mig = _optional(pynvml.nvmlDeviceGetMigMode, handle)
        return Card(
            index=index,
            uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            name=_text(pynvml.nvmlDeviceGetName(handle)),
            memory_mib=pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024),
            compute_capability=f"{major_minor[0]}.{major_minor[1]}" if major_minor else None,
            minor_number=_optional(pynvml.nvmlDeviceGetMinorNumber, handle),
            numa_node=_numa_node(handle),
            mig_enabled=bool(mig[0]) if mig else None,
        )

    def process_usage(self) -> list[ProcessUsage]:
        usage = []
        try:
            for card in self.cards():
                handle = pynvml.nvmlDeviceGetHandleByUUID(card.uuid)
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = proc.usedGpuMemory or 0  # None when the driver cannot tell
                    usage.append(ProcessUsage(proc.pid, card.uuid, used // (1024 * 1024)))
        except pynvml.NVMLError as e:
            raise InventoryError(f"NVML could not read per-process GPU memory: {e}") from e
        return usage

    def set_compute_mode(self, card_uuid: str, mode: str) -> None:
        nvml_mode = {
            "DEFAULT": pynvml.NVML_COMPUTEMODE_DEFAULT,
            "EXCLUSIVE_PROCESS": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        }[mode]
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(card_uuid)
            pynvml.nvmlDeviceSetComputeMode(handle, nvml_mode)
        except pynvml.NVMLError_NoPermission as e:
            raise InventoryError(
                f"setting compute mode {mode} on {card_uuid} needs root: run gpushare-node as root"
            ) from e
        except pynvml.NVMLError as e:
            raise InventoryError(f"setting compute mode {mode} on {card_uuid} failed: {e}") from e

    def close(self) -> None:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass  # shutting down anyway; nothing to tell the operator


def _optional(function, handle):
    """None for what the card does not support."""
    try:
        return function(handle)
    except pynvml.NVMLError:
        return None


def _numa_node(handle) -> int | None:
    # nvmlDeviceGetNumaNodeId is recent (driver >= 525); older drivers lack it.
    getter = getattr(pynvml, "nvmlDeviceGetNumaNodeId", None)
    node = _optional(getter, handle) if getter else None
    return node if isinstance(node, int) and node >= 0 else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
