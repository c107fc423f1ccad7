"""Builders shared by the extender's unit tests: node annotations and pods as the API has them."""

from __future__ import annotations

import itertools
import json

from nodemgr.common.placementkey import private_key_from_pem
from nodemgr.domain.extenderchoice import (
    PlacementTrust,
    signed_message,
    signed_text,
    with_signature,
)
from nodemgr.extender.cache import ClusterCache
from nodemgr.extender.logic import Resources
from standins.placementkeys import new_private_key_pem

MEMORY = "aliyun.com/gpu-mem"
CORE = "aliyun.com/gpu-core.percentage"
WHOLE = "nvidia.com/gpu"
KEY = "gpushare.aliyun.com/gpus"
RESOURCES = Resources(MEMORY, CORE, WHOLE, 1024)
SIGNING_KEY = private_key_from_pem(new_private_key_pem())  # the extender's, in these tests
TRUST = PlacementTrust("signed", "gpushare.aliyun.com/", SIGNING_KEY.public_key)
PLACEMENT = "gpushare.aliyun.com/placement"
_uids = itertools.count(1)


def placed(uid, node_name, cards, t=1, key=SIGNING_KEY):
    """The annotation the extender signs at bind: {container index: card} on node_name."""
    text = signed_text(uid, node_name, t, cards)
    return {PLACEMENT: with_signature(text, key.sign(signed_message(text)))}


def annotation(*cards, allocations=None, whole=(), unhealthy=()):
    """A node's gpus annotation: cards as (GiB allocated, core %) on 15 GiB T4s;
    ``allocations``: {card index: [[ns, pod, container, MiB, core], ...]}."""
    gpus = []
    for index, (gib, core) in enumerate(cards):
        mode = "whole" if index in whole else "shared" if gib or core else "idle"
        gpus.append(
            {
                "index": index,
                "uuid": f"GPU-{index}",
                "model": "Tesla T4",
                "mode": mode,
                "healthy": index not in unhealthy,
                "memory_mib": 15360,
                "memory_allocated_mib": 15360 if index in whole else gib * 1024,
                "core_allocated_percent": 100 if index in whole else core,
                "allocations": (allocations or {}).get(index, []),
            }
        )
    return json.dumps({"v": 1, "gpus": gpus})


def node(name, text=None):
    """A Node object as the API sends it (only what the extender reads, plus a bit)."""
    annotations = {"node.alpha.kubernetes.io/ttl": "0"}
    if text is not None:
        annotations[KEY] = text
    return {
        "metadata": {"name": name, "annotations": annotations, "resourceVersion": "1"},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]},
    }


def pod(name, *containers, node_name="", annotations=None, phase="Pending", init=(), uid=None):
    """A Pod object; each container (name, {resource: amount})."""

    def spec(containers):
        return [
            {"name": n, "resources": {"limits": {r: str(q) for r, q in req.items()}}}
            for n, req in containers
        ]

    obj = {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": uid or f"uid-{next(_uids)}",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "annotations": dict(annotations or {}),
        },
        "spec": {
            "containers": spec(containers),
            **({"initContainers": spec(init)} if init else {}),
        },
        "status": {"phase": phase},
    }
    if node_name:
        obj["spec"]["nodeName"] = node_name
    return obj


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def cache_with(
    nodes, pods=(), policy="binpack", clock=None, ttl=60.0, on_ignored=None
) -> ClusterCache:
    """A synced cache holding these Node and Pod objects, trusting SIGNING_KEY's placements."""
    cache = ClusterCache(
        RESOURCES,
        "gpushare.aliyun.com/",
        policy,
        ttl,
        clock or Clock(),
        trust=TRUST,
        on_ignored=on_ignored,
    )
    cache.node_handler.replace(iter(nodes))
    cache.pod_handler.replace(iter(pods))
    return cache
