"""On a machine with an NVIDIA GPU, the MPS binary and torch (``pytest -m gpu``):
a real control daemon for card 0 started by the mps library, CUDA clients with
the env gpushare-node's Allocate gives. Pins that the pinned memory limit and the
active-thread percentage are really enforced, and that quit and adoption work.
Skipped, with the reason, where any of those is missing."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from mps import CardDaemon, HealthState

pytestmark = pytest.mark.gpu

ALLOCATE = """
import torch
torch.cuda.init()
small = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
print("small ok", flush=True)
try:
    big = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    print("big allocated")
except RuntimeError as e:
    print("big refused:", str(e).splitlines()[0])
"""

COMPUTE = """
import time, torch
a = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(50):
    a = a @ a
    a = a / a.norm()
torch.cuda.synchronize()
print(time.perf_counter() - start)
"""


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
        card_uuid, "nvidia-cuda-mps-control", f"{root}/pipe", f"{root}/log", timeout_seconds=20
    )
    daemon.start()
    yield daemon
    if daemon.probe().state is not HealthState.DOWN:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def client(daemon, code, **env):
    full_env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": daemon.card_uuid,
        "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_pinned_memory_limit_is_enforced(daemon):
    out = client(daemon, ALLOCATE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1024M")
    assert "small ok" in out and "big refused" in out, out
    assert client(daemon, ALLOCATE).count("big allocated") == 1  # no limit: it fits


def test_active_thread_percentage_slows_compute(daemon):
    full = float(client(daemon, COMPUTE, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100"))
    quarter = float(client(daemon, COMPUTE, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25"))
    assert quarter / full > 1.5, (full, quarter)


def test_quit_and_adopt(daemon):
    pid = daemon.pid()
    assert pid is not None
    adopter = CardDaemon(daemon.card_uuid, daemon.binary, daemon.pipe_dir, daemon.log_dir, 20)
    assert adopter.probe().ok and adopter.pid() == pid
    adopter.stop()
    assert daemon.probe().state is HealthState.DOWN and daemon.pid() is None
