"""Is a container's GPU env what its allocation gave it? (pure)

Also which cgroup the container's processes live in; the watchdog uses the same quota
reading on each GPU process's env. The quota env may be lowered (a client value can
only further constrain, docs/mps.md) but never raised, removed, or pointed at another
MPS pipe directory or other cards.
"""

from __future__ import annotations

from hooks import gpuenv
from hooks.textsafe import quote
from nodemgr.domain.model import Allocation, CgroupKey, ContainerRef
from nodemgr.domain.podtie import pod_of, shown_pod


class CgroupError(ValueError):
    pass


def parse_cgroups(text: str) -> dict[str, str]:
    """/proc/PID/cgroup as {controllers: path}.

    Lines end at ``\n`` only, as the kernel writes them: a cgroup name may hold ``\r``,
    and reading ``/mine/x\r0::/kubepods/victim`` as two lines would put the process
    into another container's cgroup."""
    cgroups = {}
    for line in text.split("\n"):
        if not line.strip():
            continue
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            raise CgroupError(f"not a /proc/PID/cgroup line: {line!r}")
        cgroups[parts[1]] = parts[2]
    return cgroups


# How container runtimes name a container's own cgroup, as its last path component:
# ``<id>`` (runc's default /<id>, kubelet's cgroupfs driver with containerd, docker),
# ``<prefix><id>`` (cgroupfs: crio-<id>, libpod-<id>) or ``<prefix><id>.scope``
# (systemd: cri-containerd-, crio-, docker-, libpod-, runc-<id>.scope).
RUNTIME_PREFIXES = ("cri-containerd-", "crio-", "docker-", "libpod-", "runc-", "crun-")
# A sub-group the OCI runtime may put the container's processes in under its scope
# (crun/runc with the run.oci.systemd.subgroup annotation, as podman sets it).
RUNTIME_SUBGROUPS = ("container",)
# A container ID named like a systemd unit is not a container's cgroup name.
_UNIT_SUFFIXES = (
    ".service", ".slice", ".scope", ".socket", ".mount", ".target", ".swap", ".device",
    ".path", ".timer", ".automount",
)  # fmt: skip


def is_container_cgroup(path: str, container_id: str) -> bool:
    """Whether ``path``'s last component names this container's ID (the runtime's, never
    the container's choice) in one of the runtimes' forms above."""
    if not container_id or container_id in (".", "..") or container_id.endswith(_UNIT_SUFFIXES):
        return False
    parts = path.strip("/").split("/")
    if len(parts) > 1 and parts[-1] in RUNTIME_SUBGROUPS:
        parts.pop()
    name = parts[-1]
    if name == container_id:
        return True
    scope = name.removesuffix(".scope")
    return any(scope == prefix + container_id for prefix in RUNTIME_PREFIXES)


def container_cgroup(text: str, container_id: str) -> CgroupKey:
    """The cgroup that holds a container, from its init process's /proc/PID/cgroup.

    v2 when the container has its own cgroup there, else v1 memory, else pids. Only the
    container's own cgroup counts: a host cgroup (the runtime's service) would make
    every process in it the container's, and killed as such. On a hybrid host v2 may
    show the runtime unit's cgroup while v1 holds the container's.
    """
    cgroups = parse_cgroups(text)
    paths = [(h, cgroups.get(h)) for h in ("", "memory", "pids")]
    own = [(h, p) for h, p in paths if p is not None and p != "/"]
    for hierarchy, path in own:
        if is_container_cgroup(path, container_id):
            return CgroupKey(hierarchy, path)
    if not own:
        raise CgroupError(
            "the container has no cgroup of its own (every hierarchy is /): "
            "its processes could not be told from the host's"
        )
    shown = ", ".join(f"{h or 'unified'} {quote(p)}" for h, p in own)
    cid = quote(container_id)
    raise CgroupError(
        f"its cgroup ({shown}) is not a container cgroup: only a cgroup that a container "
        f"runtime made for container {cid} is accepted (its last part "
        f"{cid}, crio-{cid}, cri-containerd-{cid}.scope and the "
        "like), never a host service, slice, pod or another container's cgroup"
    )


def check_container(
    env: dict[str, str],
    allocation: Allocation | None,
    card_uuids_by_index: dict[str, str],
    mps_pipe_directory: str | None,
) -> str | None:
    """Why this container's GPU env must not start; None when it matches.
    ``allocation``: the live one its GPUSHARE_ALLOCATION_ID names; ``mps_pipe_directory``
    None: MPS is off."""
    requested = gpuenv.requested_gpus(env)
    allocation_id = env.get(gpuenv.ALLOCATION_ID)
    shown = _env_value(
        env, gpuenv.VISIBLE_DEVICES, f"all (legacy CUDA image, {gpuenv.CUDA_VERSION} set)"
    )
    if allocation_id is None:
        return (
            f"it asks for GPUs ({gpuenv.VISIBLE_DEVICES}={shown}) without a gpushare "
            "allocation: GPUs on this node are given only through the device plugin "
            "resources (request aliyun.com/gpu-mem, aliyun.com/gpu-core.percentage or "
            "whole cards in the pod spec)"
        )
    if allocation is None:
        return (
            f"{gpuenv.ALLOCATION_ID}={quote(allocation_id)} is not a live allocation on this node "
            "(released, or never made here)"
        )
    if requested is None:
        return None  # holds an allocation but asks for no GPU: harmless
    if "all" in (item.lower() for item in requested):
        return (
            f"{gpuenv.VISIBLE_DEVICES}=all: allocation {allocation.id} holds only "
            f"{_cards(allocation)}"
        )
    resolved = {card_uuids_by_index.get(item, item) for item in requested}
    if resolved != set(allocation.cards):
        return (
            f"{gpuenv.VISIBLE_DEVICES}={_env_value(env, gpuenv.VISIBLE_DEVICES)} differs from the "
            f"cards of allocation {allocation.id} ({_cards(allocation)})"
        )
    if allocation.whole:
        return None
    problem = quota_env_problem(env, allocation)
    if problem:
        return problem
    pipe = env.get(gpuenv.PIPE_DIRECTORY)
    if mps_pipe_directory is not None and pipe != mps_pipe_directory:
        return (
            f"{gpuenv.PIPE_DIRECTORY}={_env_value(env, gpuenv.PIPE_DIRECTORY)} differs from "
            f"{mps_pipe_directory}, where its card's MPS daemon is mounted"
        )
    return None


def quota_env_problem(env: dict[str, str], allocation: Allocation) -> str | None:
    """Why an env escapes a shared allocation's quota; or None."""
    if allocation.memory_units:
        value = env.get(gpuenv.PINNED_MEM_LIMIT)
        if value is None:
            return f"{gpuenv.PINNED_MEM_LIMIT} was removed (quota {allocation.memory_mib} MiB)"
        try:
            limits = gpuenv.parse_pinned_limit(value)
        except gpuenv.EnvError as e:
            return str(e)
        if set(limits) != {"0"}:
            # An entry for an ordinal the container cannot see makes the MPS
            # client drop every pinned limit (docs/mps.md).
            return (
                f"{gpuenv.PINNED_MEM_LIMIT}={quote(value)}: only device 0 is visible, name only 0"
            )
        if limits["0"] > allocation.memory_mib:
            return (
                f"{gpuenv.PINNED_MEM_LIMIT}={quote(value)} raises the quota of "
                f"{allocation.memory_mib} MiB"
            )
    if allocation.core_percent:
        value = env.get(gpuenv.ACTIVE_THREAD_PERCENTAGE)
        if value is None:
            return (
                f"{gpuenv.ACTIVE_THREAD_PERCENTAGE} was removed (share {allocation.core_percent}%)"
            )
        try:
            percent = gpuenv.parse_thread_percentage(value)  # exact ASCII form only
        except gpuenv.EnvError as e:
            return str(e)
        if not 0 < percent <= allocation.core_percent:
            return (
                f"{gpuenv.ACTIVE_THREAD_PERCENTAGE}={quote(value)} is outside the share of "
                f"{allocation.core_percent}%"
            )
    return None


def identity_conflict(
    identity: ContainerRef | None, allocation: Allocation, others: list[ContainerRef]
) -> str | None:
    """Why a container of this pod identity must not use the allocation; or None.
    Per pod, as :mod:`nodemgr.domain.podtie`; the owner kubelet reported wins, else the
    pod of containers already registered on it."""
    if identity is None:
        return None  # the runtime gave no pod identity: the caller refuses that itself
    if allocation.claim is not None:
        return None  # a claim may serve several pods: kubelet's record ties each (podtie)
    expected = allocation.owner or next(iter(others), None)
    if expected is not None and pod_of(expected) != pod_of(identity):
        return (
            f"allocation {allocation.id} belongs to pod {shown_pod(expected)}, "
            f"not to pod {shown_pod(identity)}"
        )
    return None


def _env_value(env: dict[str, str], name: str, missing: str = "(unset)") -> str:
    value = env.get(name)
    return missing if value is None else quote(value)


def _cards(allocation: Allocation) -> str:
    return ", ".join(allocation.cards)
