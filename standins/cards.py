"""Simulated cards and settings the unit tests build on (importable by tests and bench)."""

from __future__ import annotations

from nodemgr.config.loading import settings_from_mapping

GPU0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU1 = "GPU-bbbbbbbb-1111-1111-1111-111111111111"
MPS_PIPE = "/tmp/nvidia-mps"  # where a shared container finds MPS


def simulated_settings(tmp_dir: str, devices=None, **resources):
    devices = devices or [
        {"uuid": GPU0, "name": "Tesla T4", "memory_mib": 15360},
        {"uuid": GPU1, "name": "Tesla T4", "memory_mib": 15360},
    ]
    return settings_from_mapping(
        {
            "node_name": "node-a",
            "state_dir": f"{tmp_dir}/state",
            "run_dir": f"{tmp_dir}/run",
            "gpus": {"backend": "simulated", "simulated": {"devices": devices}},
            "resources": resources,
        }
    )


def env_of(allocation, **overrides):
    """The env Allocate gives a shared container (MPS on); None in overrides removes a name."""
    env = {
        "NVIDIA_VISIBLE_DEVICES": allocation.cards[0],
        "GPUSHARE_ALLOCATION_ID": allocation.id,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={allocation.memory_mib}M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(allocation.core_percent),
        "CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE,
    }
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env
