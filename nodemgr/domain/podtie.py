"""Is a container tied to the allocation whose env it carries? (pure)

An allocation id in a container's env is not a bearer token: anyone who reads it (a
log, ``kubectl describe``) could put it in a container of their own and share the quota,
or, made straight with runc, escape it. A GPU container is tied to an allocation by its
pod:

- its pod identity comes from its CRI runtime's OCI annotations
  (:mod:`hooks.podidentity`), never from its env; a container without one was not made
  by kubelet through a CRI runtime and is refused;
- kubelet's PodResources record, read at that moment, must show a container of that
  pod holding the allocation's device IDs, and no other pod holding any of them;
- the record names pods, never UIDs, so a pod created again under its name (a
  StatefulSet's) looks like the old one there: where the runtime gives the pod's UID
  and the allocation knows its owner's, they must be the same.

A DRA claim's container is tied the same way, through the record's
``dynamic_resources``, put under ``CLAIMS_RECORD`` (claim, pool, device and, from
kubelet 1.35, share ID).

The tie is per pod, not per container, on purpose: kubelet hands a regular init
container's devices on to the app containers (devicesToReuse) and does not list it in
PodResources, so it would never find its own name there. Any container of the pod may
use the pod's allocation, and the memory quota is policed over all of them together
(:mod:`nodemgr.domain.violations`): one pod spec, one author.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hooks import podidentity
from hooks.textsafe import quote
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.model import Allocation, ContainerRef

# kubelet's PodResources record: container -> resource name -> device IDs.
KubeletRecord = Mapping[ContainerRef, Mapping[str, Sequence[str]]]

NO_IDENTITY = (
    "the runtime gave no pod identity (the CRI annotations io.kubernetes.cri.sandbox-namespace, "
    "sandbox-name and container-name, or CRI-O's io.kubernetes.pod.namespace, pod.name and "
    "container.name): a GPU allocation is given only to containers of the pod kubelet "
    "allocated it to; start GPU containers through kubelet and a CRI runtime"
)


def runtime_identity(
    annotations: Mapping[str, str], runtime: str | None, claimed: Mapping[str, str]
) -> tuple[ContainerRef | None, str | None]:
    """(the container's pod identity, why it is refused or None), read again from its
    annotations; ``claimed``, what the hook read, must be the same (the daemon does not
    take the hook's word for it)."""
    try:
        identity = podidentity.resolve(dict(annotations), runtime)
    except podidentity.IdentityConflict as e:
        return None, str(e)
    if dict(claimed) != identity:
        return None, (
            f"the hook read the pod identity {_shown(claimed)} from annotations that give "
            f"{_shown(identity)}: the hook and the daemon disagree (run `nodemgr install` "
            "again so the runtime runs the hook installed with this daemon)"
        )
    if not identity:
        return None, None
    return ContainerRef(identity["namespace"], identity["pod"], identity["container"]), None


def runtime_pod_uid(annotations: Mapping[str, str], runtime: str | None) -> str | None:
    """The pod UID the runtime's keys give; None for none or two pods (``runtime_identity``
    refuses those)."""
    try:
        return podidentity.resolve(dict(annotations), runtime).get("uid") or None
    except podidentity.IdentityConflict:
        return None


def _shown(identity: Mapping[str, str]) -> str:
    if not identity:
        return "(none)"
    return "/".join(quote(identity.get(f, "?")) for f in podidentity.REQUIRED)


# No extended resource name can be it: those always hold a '/'.
CLAIMS_RECORD = "dynamic-resources"


def claim_record_id(namespace: str, name: str, pool: str, device: str, share_id: str) -> str:
    """``<ns>/<claim>/<pool>/<device>#<share ID>`` (share ID empty before kubelet 1.35)."""
    return f"{namespace}/{name}/{pool}/{device}#{share_id}"


def _claim_holds(allocation: Allocation, record_id: str) -> bool:
    claim = allocation.claim
    assert claim is not None
    device, _, share = record_id.rpartition("#")
    for result in claim.results:
        if device == f"{claim.namespace}/{claim.name}/{result.pool}/{result.device}" and (
            share == "" or share == (result.share_id or "")
        ):
            return True
    return False


def pod_of(ref: ContainerRef) -> str:
    """namespace/pod as a key: compared, never shown."""
    return f"{ref.namespace}/{ref.pod}"


def shown_pod(ref: ContainerRef) -> str:
    return f"{quote(ref.namespace)}/{quote(ref.pod)}"


def holders(
    allocation: Allocation, record: KubeletRecord, resource_names: Mapping[ResourceKind, str]
) -> set[ContainerRef]:
    """The containers kubelet's record shows holding any of the allocation's devices."""
    if allocation.claim is not None:
        return {
            ref
            for ref, resources in record.items()
            if any(_claim_holds(allocation, i) for i in resources.get(CLAIMS_RECORD, ()))
        }
    held = {(resource_names.get(kind), device_id) for kind, device_id in allocation.device_pairs()}
    return {
        ref
        for ref, resources in record.items()
        for resource_name, device_ids in resources.items()
        if any((resource_name, device_id) in held for device_id in device_ids)
    }


def other_pod_of_the_name(
    identity: ContainerRef, allocation: Allocation, pod_uid: str | None
) -> bool:
    """Whether ``allocation`` was made for another pod of ``identity``'s pod's name
    (another UID), judged only where both UIDs are known."""
    owner = allocation.owner
    return (
        bool(pod_uid)
        and owner is not None
        and pod_of(owner) == pod_of(identity)
        and not allocation.held_by(identity.namespace, identity.pod, pod_uid or "")
    )


def pod_tie_problem(
    identity: ContainerRef,
    allocation: Allocation,
    holding: set[ContainerRef],
    pod_uid: str | None = None,
) -> str | None:
    """Why kubelet's record (``holding``: :func:`holders`, not empty) does not tie the
    container of ``identity`` to the allocation (see the module); None when it does."""
    pods = sorted({pod_of(ref) for ref in holding})
    shown = ", ".join(sorted({shown_pod(ref) for ref in holding}))
    what = f"allocation {allocation.id} ({', '.join(allocation.cards)})"
    if pod_of(identity) not in pods:
        return (
            f"kubelet gives {what} to pod {shown}, not to pod {shown_pod(identity)}: an "
            "allocation's env grants GPUs only to containers of the pod it was allocated "
            "to (request aliyun.com/gpu-mem, or reference the claim, in this pod's own spec)"
        )
    if other_pod_of_the_name(identity, allocation, pod_uid):
        return (
            f"{what} was made for pod {shown_pod(identity)} with UID "
            f"{quote(allocation.owner_uid or '')}, and this container's pod of that name has "
            f"UID {quote(pod_uid or '')}: a pod deleted and created again under its name gets "
            "an allocation of its own at its admission, never the old pod's"
        )
    if len(pods) > 1 and allocation.claim is None:  # a claim may be shared by several pods
        return (
            f"kubelet gives the devices of {what} to several pods ({shown}); "
            "the next reconcile splits it (start the container again then)"
        )
    return None


def pods_allocation(
    identity: ContainerRef,
    allocations: Sequence[Allocation],
    record: KubeletRecord,
    resource_names: Mapping[ResourceKind, str],
    cards: set[str],
    pod_uid: str | None = None,
) -> Allocation | None:
    """The allocation kubelet's record gives the container's own pod on ``cards`` (those
    its env asks for), when the ID in its env names another or none.

    An env's ID goes stale without anyone's fault: a ledger rebuilt from kubelet's record
    adopts the pod's devices under a new ID, a split of two wrongly linked pods gives the
    second a new ID, while kubelet replays the env it cached. Exactly one candidate, or
    the one kubelet names this container holding; anything else is ambiguous: None."""
    mine = pod_of(identity)
    candidates = []
    for allocation in allocations:
        if set(allocation.cards) != cards or other_pod_of_the_name(identity, allocation, pod_uid):
            continue
        holding = holders(allocation, record, resource_names)
        if holding and {pod_of(ref) for ref in holding} == {mine}:
            candidates.append((allocation, identity in holding))
    if len(candidates) == 1:
        return candidates[0][0]
    named = [allocation for allocation, by_name in candidates if by_name]
    return named[0] if len(named) == 1 else None
