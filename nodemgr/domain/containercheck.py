"""Is a container's GPU env what its allocation gave it? (pure)

The runtime hook sends the GPU env of every container that asks for GPUs;
this module says whether it matches a live allocation, and which cgroup the
container's processes live in. The run-time watchdog uses the same quota
reading on each GPU process's own env.

The quota env may be lowered (a client value can only further constrain, see
docs/mps.md) but never raised, removed, pointed at another MPS pipe
directory or at other cards.
"""

from __future__ import annotations

from hooks import gpuenv
from nodemgr.domain.model import Allocation, CgroupKey, ContainerRef


class CgroupError(ValueError):
    pass


def parse_cgroups(text: str) -> dict[str, str]:
    """/proc/PID/cgroup as {controllers: path}; ``hierarchy-ID:controllers:path`` lines."""
    cgroups = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            raise CgroupError(f"not a /proc/PID/cgroup line: {line!r}")
        cgroups[parts[1]] = parts[2]
    return cgroups


def container_cgroup(text: str) -> CgroupKey:
    """The cgroup that holds a container, from its init process's /proc/PID/cgroup.

    The unified (v2) hierarchy when the container has its own cgroup there,
    else the v1 memory hierarchy (where GPU memory belongs), else pids.
    """
    cgroups = parse_cgroups(text)
    for hierarchy in ("", "memory", "pids"):
        path = cgroups.get(hierarchy)
        if path is not None and path != "/":
            return CgroupKey(hierarchy, path)
    raise CgroupError(
        "the container has no cgroup of its own (every hierarchy is /): "
        "its processes could not be told from the host's"
    )


def check_container(
    env: dict[str, str],
    allocation: Allocation | None,
    card_uuids_by_index: dict[str, str],
    mps_pipe_directory: str | None,
) -> str | None:
    """Why this container's GPU env must not start; None when it matches.

    ``allocation`` is the live allocation its GPUSHARE_ALLOCATION_ID names
    (None if it names none or an unknown one); ``mps_pipe_directory`` is where
    shared containers must find MPS (None: MPS is off).
    """
    requested = gpuenv.requested_gpus(env)
    allocation_id = env.get(gpuenv.ALLOCATION_ID)
    shown = env.get(gpuenv.VISIBLE_DEVICES, f"all (legacy CUDA image, {gpuenv.CUDA_VERSION} set)")
    if allocation_id is None:
        return (
            f"it asks for GPUs ({gpuenv.VISIBLE_DEVICES}={shown}) without a gpushare "
            "allocation: GPUs on this node are given only through the device plugin "
            "resources (request aliyun.com/gpu-mem, aliyun.com/gpu-core.percentage or "
            "whole cards in the pod spec)"
        )
    if allocation is None:
        return (
            f"{gpuenv.ALLOCATION_ID}={allocation_id} is not a live allocation on this node "
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
            f"{gpuenv.VISIBLE_DEVICES}={env.get(gpuenv.VISIBLE_DEVICES)} differs from the "
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
            f"{gpuenv.PIPE_DIRECTORY}={'(unset)' if pipe is None else pipe} differs from "
            f"{mps_pipe_directory}, where its card's MPS daemon is mounted"
        )
    return None


def quota_env_problem(env: dict[str, str], allocation: Allocation) -> str | None:
    """Why an env escapes a shared allocation's quota (removed, raised, unreadable); or None."""
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
            return f"{gpuenv.PINNED_MEM_LIMIT}={value}: only device 0 is visible, name only 0"
        if limits["0"] > allocation.memory_mib:
            return (
                f"{gpuenv.PINNED_MEM_LIMIT}={value} raises the quota of {allocation.memory_mib} MiB"
            )
    if allocation.core_percent:
        value = env.get(gpuenv.ACTIVE_THREAD_PERCENTAGE)
        if value is None:
            return (
                f"{gpuenv.ACTIVE_THREAD_PERCENTAGE} was removed (share {allocation.core_percent}%)"
            )
        try:
            percent = float(value)
        except ValueError:
            return f"{gpuenv.ACTIVE_THREAD_PERCENTAGE}={value!r} is not a number"
        if not 0 < percent <= allocation.core_percent:
            return (
                f"{gpuenv.ACTIVE_THREAD_PERCENTAGE}={value} is outside the share of "
                f"{allocation.core_percent}%"
            )
    return None


def identity_conflict(
    identity: ContainerRef | None, allocation: Allocation, others: list[ContainerRef]
) -> str | None:
    """Why a container of this pod identity must not use the allocation; or None.

    The owner kubelet reported wins; without one, containers already
    registered on the allocation bind it to their identity.
    """
    if identity is None:
        return None  # the runtime gave no pod identity: nothing to compare
    expected = allocation.owner or next(iter(others), None)
    if expected is not None and expected != identity:
        return f"allocation {allocation.id} belongs to {expected}, not {identity}"
    return None


def _cards(allocation: Allocation) -> str:
    return ", ".join(allocation.cards)
