"""Shared fixtures: simulated cards and settings for unit tests."""

from __future__ import annotations

import pytest

from nodemgr.config import settings_from_mapping

GPU0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU1 = "GPU-bbbbbbbb-1111-1111-1111-111111111111"


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


@pytest.fixture
def settings(tmp_path):
    return simulated_settings(str(tmp_path))
