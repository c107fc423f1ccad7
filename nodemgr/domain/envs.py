"""The env an Allocate response gives a container (pure).

Only what is known goes in: kubelet keeps the first value it sees for an env name
across a container's resources, so a placeholder could never be corrected later.
"""

from __future__ import annotations

# The names the runtime hook checks come from one place.
from hooks.gpuenv import (
    ACTIVE_THREAD_PERCENTAGE,
    ALLOCATION_ID,
    PINNED_MEM_LIMIT,
    PIPE_DIRECTORY,
    VISIBLE_DEVICES,
)
from nodemgr.domain.model import Allocation

# docs/gpushare-compat.md: workloads written for gpushare's device plugin read these.
GPU_MEM_IDX = "ALIYUN_COM_GPU_MEM_IDX"
GPU_MEM_CONTAINER = "ALIYUN_COM_GPU_MEM_CONTAINER"
GPU_MEM_DEV = "ALIYUN_COM_GPU_MEM_DEV"
GPU_MEM_POD = "ALIYUN_COM_GPU_MEM_POD"


def shared_envs(
    allocation: Allocation,
    card_uuid: str,
    card_index: int,
    card_memory_units: int,
    mps_pipe_directory: str | None = None,
    pod_memory_units: int | None = None,
) -> dict[str, str]:
    """ALIYUN_COM_GPU_MEM_POD (the pod's total) only when the pod cache knows the pod."""
    envs = {
        VISIBLE_DEVICES: card_uuid,
        ALLOCATION_ID: allocation.id,
        GPU_MEM_IDX: str(card_index),
        GPU_MEM_DEV: str(card_memory_units),
    }
    if allocation.memory_units:
        # "0=" is the device ordinal inside the container, which sees one card.
        envs[PINNED_MEM_LIMIT] = f"0={allocation.memory_mib}M"
        envs[GPU_MEM_CONTAINER] = str(allocation.memory_units)
    if allocation.core_percent:
        envs[ACTIVE_THREAD_PERCENTAGE] = str(allocation.core_percent)
    if mps_pipe_directory:
        envs[PIPE_DIRECTORY] = mps_pipe_directory
    if pod_memory_units is not None:
        envs[GPU_MEM_POD] = str(pod_memory_units)
    return envs


def whole_envs(allocation: Allocation, card_uuids: list[str]) -> dict[str, str]:
    return {VISIBLE_DEVICES: ",".join(card_uuids), ALLOCATION_ID: allocation.id}
