"""A ledger made from nothing at start: the prepared claims are taken back from their CDI specs.

kubelet prepares a claim once and does not ask again until it restarts, so a lost
ledger (moved aside after a corruption, state_dir lost while the daemon was stopped)
would leave the running containers of every claim without an allocation: the
watchdog would take their GPU processes for unallocated ones. The CDI spec of each
prepared claim is still in ``dra.cdi_dir`` (written by this daemon, root's), and it
holds what the allocation was: the claim UID (the file name), its devices and share
IDs (the CDI device names), the allocation ID, the card and the quotas (the env).
kubelet's PodResources record gives the claim's namespace and name (its
``dynamic_resources`` list the same pool, device and share). Each claim found in
both is recorded again under its old allocation ID, before the hook server and the
watchdog start, so that the containers' registrations recovered from their cgroup
marks (nodemgr.allocation.recovery) find their allocation.

A claim the record does not list (its pods are gone, or kubelet cannot be read now)
is not recovered; its spec is then removed at start (``DraDriver.restore``), and
kubelet's next prepare of it (after kubelet's restart) records it anew. Request
names are not in either source: they are learnt at that next prepare.

What it must not do: trust a spec it did not write (only this driver's files, parsed
strictly; a spec that does not parse is skipped and logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from hooks.gpuenv import ACTIVE_THREAD_PERCENTAGE, ALLOCATION_ID, PINNED_MEM_LIMIT
from nodemgr.allocation.allocator import Allocator
from nodemgr.domain.claims import ClaimDemand, DeviceCard
from nodemgr.domain.envs import GPU_MEM_IDX
from nodemgr.domain.model import Allocation, ClaimRef, ClaimResult, ContainerRef
from nodemgr.domain.podtie import CLAIMS_RECORD
from nodemgr.dra.cdifiles import CdiDirectory
from nodemgr.errors import GpushareError

log = logging.getLogger(__name__)

KubeletRecord = Mapping[ContainerRef, Mapping[str, Sequence[str]]]


def recover_claims(
    allocator: Allocator,
    cdi_directory: CdiDirectory,
    devices: Mapping[str, DeviceCard],
    pool: str,
    unit_mib: int,
    kubelet_record: Callable[[], KubeletRecord],
) -> list[Allocation]:
    """The claims taken back into a ledger made at this start (see the module)."""
    uids = cdi_directory.claim_uids()
    if not uids:
        return []
    try:
        record = kubelet_record()
    except GpushareError as e:
        log.error(
            "the ledger was made at this start and %d claims have CDI specs, but kubelet's "
            "record cannot be read (%s): they are not recovered; their containers' GPU "
            "processes may be reported as unallocated until kubelet prepares them again",
            len(uids),
            e,
        )
        return []
    names = _claim_names(record)
    recovered = []
    for uid in uids:
        try:
            demand, allocation_id = _demand(cdi_directory, uid, devices, pool, unit_mib, names)
            recovered.append(allocator.adopt_claim(demand, allocation_id))
        except (ValueError, KeyError, GpushareError) as e:
            log.warning("claim UID %s: not recovered from its CDI spec: %s", uid, e)
    log.warning(
        "the ledger was made at this start: recovered %d of %d prepared claims from their "
        "CDI specs and kubelet's record",
        len(recovered),
        len(uids),
    )
    return recovered


def _claim_names(record: KubeletRecord) -> dict[tuple[str, str, str], tuple[str, str]]:
    """(pool, device, share ID) -> (namespace, name) of the claims kubelet lists."""
    names = {}
    for resources in record.values():
        for record_id in resources.get(CLAIMS_RECORD, ()):
            where, _, share = record_id.rpartition("#")
            namespace, name, pool, device = where.split("/", 3)
            names[(pool, device, share)] = (namespace, name)
    return names


def _demand(
    cdi_directory: CdiDirectory,
    uid: str,
    devices: Mapping[str, DeviceCard],
    pool: str,
    unit_mib: int,
    names: Mapping[tuple[str, str, str], tuple[str, str]],
) -> tuple[ClaimDemand, str]:
    spec = cdi_directory.read(uid)
    if spec is None:
        raise ValueError("its spec cannot be read")
    results, envs = [], []
    for entry in spec["devices"]:
        rest = str(entry["name"]).removeprefix(f"{uid}-")
        device = next((d for d in devices if rest == d or rest.startswith(d + "-")), None)
        if device is None:
            raise ValueError(f"CDI device {entry['name']!r} names no device of this node")
        share = rest[len(device) + 1 :] or None
        results.append(ClaimResult("", pool, device, share))
        envs.append(dict(str(e).split("=", 1) for e in entry["containerEdits"].get("env", [])))
    env = envs[0]
    if any(e != env for e in envs):
        raise ValueError("its devices carry different env")
    found = {names.get((pool, r.device, r.share_id or "")) for r in results}
    found |= {names.get((pool, r.device, "")) for r in results}  # kubelet before 1.35
    found.discard(None)
    if len(found) != 1:
        raise ValueError("kubelet's record lists no pod using it (or several claims)")
    [named] = found
    assert named is not None
    claim = ClaimRef(uid, named[0], named[1], tuple(results))
    cards = tuple(devices[r.device].uuid for r in results)
    if GPU_MEM_IDX not in env:  # whole cards: only the cards and the ID
        return ClaimDemand(claim, cards, whole=True), env[ALLOCATION_ID]
    memory_mib = int(env.get(PINNED_MEM_LIMIT, "0=0M").removeprefix("0=").removesuffix("M"))
    if memory_mib % unit_mib:
        raise ValueError(f"its memory limit {memory_mib} MiB is no whole number of units")
    cores = int(env.get(ACTIVE_THREAD_PERCENTAGE, "0"))
    demand = ClaimDemand(claim, cards, False, memory_mib // unit_mib, cores)
    return demand, env[ALLOCATION_ID]
