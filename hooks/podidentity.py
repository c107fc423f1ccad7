"""Which pod a container belongs to, from the OCI annotations its CRI runtime wrote (pure;
standard library only: the hook reads the keys, the daemon judges them the same way).

Each CRI runtime writes the identity under keys of its own family, after the pod's own
annotations, so its keys always name the real pod:

- containerd: ``io.kubernetes.cri.sandbox-namespace``, ``sandbox-name``, ``sandbox-uid``
  and ``io.kubernetes.cri.container-name``;
- CRI-O (and podman, given with ``--annotation``): kubelet's labels
  ``io.kubernetes.pod.namespace``, ``.name``, ``.uid`` and ``io.kubernetes.container.name``.

The other family's keys are the pod author's to write: CRI-O copies every pod annotation
into its containers' OCI annotations, and containerd passes ``io.kubernetes.pod.*`` on
where ``pod_annotations`` lets them through. So the identity is read only from the family
of the runtime the hook was installed for (``--runtime``); the other family's keys, where
present, must name the same, else the container is refused naming both: a pod may repeat
its own identity, never claim another's. Without ``--runtime`` the family whose namespace,
pod and container keys are all present is read (containerd's first), with the same check.
"""

from hooks.textsafe import quote

CONTAINERD = "containerd"
CRIO = "cri-o"
RUNTIMES = (CONTAINERD, CRIO)
RUNTIME_NAMES = {CONTAINERD: "containerd", CRIO: "CRI-O"}
FAMILIES = {
    CONTAINERD: {
        "namespace": "io.kubernetes.cri.sandbox-namespace",
        "pod": "io.kubernetes.cri.sandbox-name",
        "uid": "io.kubernetes.cri.sandbox-uid",
        "container": "io.kubernetes.cri.container-name",
    },
    CRIO: {
        "namespace": "io.kubernetes.pod.namespace",
        "pod": "io.kubernetes.pod.name",
        "uid": "io.kubernetes.pod.uid",
        "container": "io.kubernetes.container.name",
    },
}
FAMILY_KEYS = {
    CONTAINERD: "io.kubernetes.cri.*",
    CRIO: "io.kubernetes.pod.*, io.kubernetes.container.name",
}
KEYS = tuple(key for family in FAMILIES.values() for key in family.values())
REQUIRED = ("namespace", "pod", "container")  # the uid is compared, never required


class IdentityConflict(ValueError):
    """The annotations name two different pods or containers; the message names both."""


def identity_keys(annotations: object) -> dict[str, str]:
    """The identity keys among ``annotations`` (both families), with their string values."""
    if not isinstance(annotations, dict):
        return {}
    return {k: v for k in KEYS if isinstance(v := annotations.get(k), str)}


def resolve(found: dict[str, str], runtime: str | None) -> dict[str, str]:
    """The identity (``namespace``, ``pod``, ``container``, and ``uid`` when written) that
    ``runtime``'s keys among ``found`` (:func:`identity_keys`) give; {} where they give no
    whole one. IdentityConflict when a key of the other family names something else."""
    if runtime is not None and runtime not in FAMILIES:
        raise ValueError(f"unknown runtime {runtime!r} (known: {', '.join(RUNTIMES)})")
    read = runtime or next(
        (name for name in RUNTIMES if all(found.get(FAMILIES[name][f]) for f in REQUIRED)),
        CONTAINERD,
    )
    keys = FAMILIES[read]
    identity = {field: found[key] for field, key in keys.items() if found.get(key)}
    if not all(field in identity for field in REQUIRED):
        identity = {}
    for other in RUNTIMES:
        if other == read:
            continue
        differing = [
            field
            for field, key in FAMILIES[other].items()
            if key in found and found[key] != identity.get(field)
        ]
        if differing:
            raise IdentityConflict(_conflict(found, read, other, runtime is not None, differing))
    return identity


def _named(found: dict[str, str], family: str) -> str:
    keys = FAMILIES[family]
    parts = [quote(found[keys[f]]) if keys[f] in found else "?" for f in REQUIRED]
    named = "/".join(parts)
    if keys["uid"] in found:
        named += f" (uid {quote(found[keys['uid']])})"
    return named


def _conflict(
    found: dict[str, str], read: str, other: str, installed_for: bool, differing: list[str]
) -> str:
    if installed_for:
        said = f"{RUNTIME_NAMES[read]}, the runtime this hook was installed for, names"
    else:
        said = f"{RUNTIME_NAMES[read]}'s keys name"
    return (
        f"its annotations name two pods: {said} {_named(found, read)} ({FAMILY_KEYS[read]}), "
        f"but {RUNTIME_NAMES[other]}'s keys name {_named(found, other)} ({FAMILY_KEYS[other]}; "
        f"{', '.join(differing)} differ). A pod's own annotations reach its containers' (CRI-O "
        "copies them all), so only the runtime's own keys say which pod a container is: "
        f"remove the {FAMILY_KEYS[other]} annotations from the pod, or make them name the pod "
        "itself"
    )
