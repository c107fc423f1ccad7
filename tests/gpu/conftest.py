"""What the GPU tests share: the card they run on (skipped, with the reason, without an
NVIDIA GPU, its MPS binary or torch) and a real control daemon for it, started by the mps
library (its own pipe, log and client directories) and quit at the end."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile

import pytest

from mps import CardDaemon, HealthState


@pytest.fixture(scope="module")
def card_uuid():
    if not shutil.which("nvidia-cuda-mps-control"):
        pytest.skip("nvidia-cuda-mps-control is not on PATH")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (CUDA clients are torch programs)")
    from nodemgr.config.schema import GpuSettings
    from nodemgr.errors import InventoryError
    from nodemgr.inventory import open_inventory

    try:
        inventory = open_inventory(GpuSettings(backend="nvml"))
    except InventoryError as e:
        pytest.skip(f"no usable NVIDIA GPU here: {e}")
    return inventory.cards()[0].uuid


@pytest.fixture
def daemon(card_uuid):
    root = tempfile.mkdtemp(prefix="mpsgpu-")
    daemon = CardDaemon(
        card_uuid,
        "nvidia-cuda-mps-control",
        f"{root}/pipe",
        f"{root}/log",
        timeout_seconds=20,
        client_dir=f"{root}/client",
    )
    daemon.start()
    yield daemon
    if daemon.probe().state is not HealthState.DOWN:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)
