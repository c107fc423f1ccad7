"""Simulated GPUs: cards from the config, per-process usage from a JSON file.

The usage file is ``{"processes": [{"pid": 1234, "gpu": "GPU-...", "used_mib": 2048}]}``
and is re-read on every ``process_usage()`` call, so a test or demo can change
what the "GPU" reports while the daemon runs. A missing file means no
processes; a malformed one is an InventoryError naming the file and the entry.
"""

from __future__ import annotations

import json
from typing import TypeGuard

from nodemgr.config.schema import SimulatedSettings
from nodemgr.errors import InventoryError
from nodemgr.inventory.base import COMPUTE_MODES, Card, ProcessUsage


class SimulatedInventory:
    def __init__(self, settings: SimulatedSettings):
        self._cards = tuple(
            Card(index=i, uuid=d.uuid, name=d.name, memory_mib=d.memory_mib)
            for i, d in enumerate(settings.devices)
        )
        self._usage_file = settings.usage_file
        # What NVML would hold; simulated cards start in DEFAULT like real ones.
        self.compute_modes = {card.uuid: "DEFAULT" for card in self._cards}

    def cards(self) -> tuple[Card, ...]:
        return self._cards

    def process_usage(self) -> list[ProcessUsage]:
        if not self._usage_file:
            return []
        try:
            with open(self._usage_file, encoding="utf-8") as f:
                document = json.load(f)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            raise InventoryError(f"simulated usage file {self._usage_file}: {e}") from e
        return parse_usage(document, self._usage_file, {c.uuid for c in self._cards})

    def set_compute_mode(self, card_uuid: str, mode: str) -> None:
        if card_uuid not in self.compute_modes or mode not in COMPUTE_MODES:
            raise InventoryError(f"cannot set compute mode {mode!r} on {card_uuid!r}")
        self.compute_modes[card_uuid] = mode

    def close(self) -> None:
        pass


def parse_usage(document: object, source: str, known_uuids: set[str]) -> list[ProcessUsage]:
    if not isinstance(document, dict) or not isinstance(document.get("processes"), list):
        raise InventoryError(f'{source}: expected {{"processes": [...]}}')
    usage = []
    for i, entry in enumerate(document["processes"]):
        where = f"{source}: processes[{i}]"
        if not isinstance(entry, dict):
            raise InventoryError(f"{where}: expected an object with pid, gpu, used_mib")
        pid, gpu, used = entry.get("pid"), entry.get("gpu"), entry.get("used_mib")
        if not _is_int(pid) or pid <= 0:
            raise InventoryError(f"{where}.pid: expected a positive integer (got {pid!r})")
        if gpu not in known_uuids:
            raise InventoryError(f"{where}.gpu: {gpu!r} is not one of the simulated cards")
        if not _is_int(used) or used < 0:
            raise InventoryError(f"{where}.used_mib: expected an integer >= 0 (got {used!r})")
        usage.append(ProcessUsage(pid=pid, gpu_uuid=gpu, used_mib=used))
    return usage


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
