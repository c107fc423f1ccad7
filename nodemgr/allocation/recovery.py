"""A ledger made from nothing at start: the running containers' work is taken back.

When the ledger did not exist at start (moved aside after a corruption, state_dir
lost while the daemon was stopped) but containers admitted earlier still run, their
registrations are read back from the marks on their cgroups
(nodemgr.enforcement.cgroupmarks), kubelet's PodResources record is adopted at once
with each container's old allocation ID, and the registrations whose allocation is
then live are stored again. So in-quota processes are not judged "unallocated", and
the env kubelet replays at a container restart (with the old ID) is still accepted.

This runs before the hook server and the watchdog start. When kubelet cannot be
read now, the old IDs stay with the allocator and the first reconcile uses them;
until then the recovered containers' GPU processes may be reported as unallocated,
which the log says.

The marks and kubelet's record are read through the callables it is handed (the
daemon's wiring passes the cgroup marks reader and the PodResources client): the
I/O stays at the edge, the decisions here.

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
    """Take back the running containers' registrations into a ledger made at this start.

    Returns the registrations stored again (empty when the ledger was not new or no
    container carries a mark)."""
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
