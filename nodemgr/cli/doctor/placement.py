"""Doctor's ``placement key`` check: whose card choice this node will honour.

Under ``signed``: FAIL when the public key is set but unusable (every placement would be
ignored), WARN when none is set (the node places every pod itself). ``annotations``
WARNs: pod owners can choose their card and their place in the queue.
"""

from __future__ import annotations

from nodemgr.cli.doctor.host import Host
from nodemgr.cli.doctor.report import FAIL, PASS, WARN, Result
from nodemgr.common.placementkey import PlacementKeyError, read_public_key
from nodemgr.config.schema import Settings

PLACEMENT_CHECK = "placement key"
_MAKE = (
    "python deploy/render.py placement-keys --dir keys, then copy keys/placement.pub to this "
    "node and name it in kubernetes.placement_public_key (deploy/README.md)"
)


def check_placement_key(settings: Settings, host: Host) -> Result:
    kubernetes = settings.kubernetes
    if not kubernetes.enabled:
        return Result(PLACEMENT_CHECK, PASS, "not used: kubernetes.enabled is false")
    if kubernetes.placement_trust == "annotations":
        return Result(
            PLACEMENT_CHECK,
            WARN,
            "kubernetes.placement_trust is annotations: the gpushare annotations of any pod "
            "are honoured, so a pod owner can choose its card and its place in the queue",
            "use gpushare-scheduler and set kubernetes.placement_trust: signed with its "
            "public key in kubernetes.placement_public_key",
        )
    path = kubernetes.placement_public_key
    if not path:
        return Result(
            PLACEMENT_CHECK,
            WARN,
            "no kubernetes.placement_public_key: the scheduler extender's card choices are "
            "ignored and this node places every pod by its own policy",
            _MAKE,
        )
    try:
        read_public_key(host.path(path))
    except (OSError, PlacementKeyError) as e:
        problem = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return Result(
            PLACEMENT_CHECK,
            FAIL,
            f"kubernetes.placement_public_key {path} is unusable ({problem}): every "
            "placement the extender signed is ignored",
            f"put gpushare-scheduler's public key (placement.pub) at {path}; {_MAKE}",
        )
    return Result(
        PLACEMENT_CHECK,
        PASS,
        f"{path}: an Ed25519 public key; only placements gpushare-scheduler signed are honoured",
    )
