"""The one place that reads the kernel facts behind an allocation's isolation (I/O).

``dmem_regions``: the cards with a region in the cgroup v2 ``dmem`` controller (kernel
6.14+): enabled at the root and a line of the root's ``dmem.capacity`` naming the
card's PCI address (``drm/0000:03:00.0/vram0 16106127360``), which comes from
``/proc/driver/nvidia/gpus/<address>/information``. What cannot be read is never
claimed. Read once at start: regions appear when the driver loads, before the daemon.

What it must not do: decide levels (nodemgr.domain.isolation does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
MAX_READ_BYTES = 1024 * 1024  # these files are a few lines


def dmem_regions(
    card_uuids: Iterable[str], cgroup_root: str = CGROUP_ROOT, nvidia_gpus: str = NVIDIA_GPUS
) -> dict[str, str]:
    controllers = _read(os.path.join(cgroup_root, "cgroup.controllers"))
    if controllers is None or "dmem" not in controllers.split():
        return {}
    capacity = _read(os.path.join(cgroup_root, "dmem.capacity"))
    if not capacity:
        return {}
    regions = [line.split()[0] for line in capacity.splitlines() if line.split()]
    addresses = _pci_addresses(nvidia_gpus)
    found = {}
    for uuid in card_uuids:
        address = addresses.get(uuid)
        if address is None:
            continue
        for region in regions:
            # drm/<PCI address>/<memory>
            if address.lower() in region.lower().split("/"):
                found[uuid] = region
                break
    if found:
        log.info("kernel dmem regions: %s", ", ".join(f"{u}: {r}" for u, r in found.items()))
    return found


def _pci_addresses(nvidia_gpus: str) -> dict[str, str]:
    try:
        addresses = os.listdir(nvidia_gpus)
    except OSError:
        return {}
    found = {}
    for address in addresses:
        text = _read(os.path.join(nvidia_gpus, address, "information")) or ""
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "GPU UUID" and value.strip():
                found[value.strip()] = address
    return found


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_READ_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
