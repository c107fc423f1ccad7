"""A ledger made from nothing at start: the running containers' work is taken back.

When the ledger did not exist at start (moved aside after a corruption, state_dir lost)
but earlier containers still run, their registrations are read back from their cgroup
marks (nodemgr.enforcement.cgroupmarks), kubelet's record is adopted with each
container's old allocation ID, and the registrations are stored again. So in-quota
processes are not judged unallocated, and the env kubelet replays at a restart is
still accepted. Runs before the hook server and the watchdog; when kubelet cannot be
read now, the first reconcile adopts with the old IDs, and until then the log says the
containers' processes may be reported unallocated.

What it must not do: trust anything a container wrote (marks are ``trusted.*``
attributes, which containers cannot set; see nodemgr.enforcement.cgroupmarks);
read cgroups or call kubelet itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.model import Registration
from nodemgr.domain.podtie import KubeletRecord
from nodemgr.errors import GpushareError

log = logging.getLogger(__name__)


def recover_registrations(
    ledger: Ledger,
    allocator: Allocator,
    marks: Callable[[], list[Registration]],
    kubelet_record: Callable[[], KubeletRecord],
) -> list[Registration]:
    """The registrations stored again (empty when the ledger was not new)."""
    if not ledger.created:
        return []
    found = marks()
    if not found:
        return []
    hints = {r.identity: r.allocation_id for r in found if r.identity is not None}
    log.warning(
        "the ledger %s was made at this start but %d containers registered before still "
        "run: taking back their registrations and allocation IDs",
        ledger.path,
        len(found),
    )
    adopted = True
    try:
        allocator.reconcile(kubelet_record(), hints)
    except GpushareError as e:
        adopted = False
        allocator.keep_id_hints(hints)
        log.error(
            "cannot read kubelet's record now (%s): the first reconcile adopts it with the "
            "old IDs; until then the GPU processes of %d recovered containers may be "
            "reported as unallocated",
            e,
            len(found),
        )
    recovered = []
    for registration in found:
        if adopted and allocator.allocation(registration.allocation_id) is None:
            log.warning(
                "container %s (%s) was registered on allocation %s, which kubelet's record "
                "does not give back: not recovered",
                registration.container_id,
                registration.identity or "no pod identity",
                registration.allocation_id,
            )
            continue
        try:
            ledger.put_registration(registration)
        except GpushareError as e:
            log.error("cannot store the recovered container %s: %s", registration.container_id, e)
            continue
        recovered.append(registration)
    log.warning(
        "recovered %d of %d container registrations from their cgroups into the ledger %s",
        len(recovered),
        len(found),
        ledger.path,
    )
    return recovered
