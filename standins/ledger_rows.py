"""Allocation rows for ledger tests (also built inside a killed child process)."""

from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE


def allocation(id_="ga-1", units=2, percent=3, owner=None):
    devices = {
        MEM: tuple(f"GPU-a-_-{j}" for j in range(units)),
        CORE: tuple(f"GPU-a-_-c{j}" for j in range(percent)),
    }
    return Allocation(
        id=id_,
        devices={kind: ids for kind, ids in devices.items() if ids},
        memory_mib=units * 1024,
        created_at=1000.0,
        owner=owner,
    )
