"""On a machine with an NVIDIA GPU (``pytest -m gpu``): the NVML backend reads real
cards, facts a board lacks are None rather than errors, and per-process usage works.
Skipped where NVML cannot initialise (no driver), with the reason."""

import importlib.util
import os
import tempfile

import pytest

from nodemgr.config.schema import GpuSettings
from nodemgr.errors import InventoryError
from nodemgr.inventory import open_inventory
from tests.gpu.clients import finish, start_client

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def inventory():
    try:
        inventory = open_inventory(GpuSettings(backend="nvml"))
    except InventoryError as e:
        pytest.skip(f"no usable NVIDIA GPU here: {e}")
    yield inventory
    inventory.close()


def test_cards_are_described_one_by_one(inventory):
    cards = inventory.cards()
    assert cards, "NVML initialised but reported no GPUs"
    assert [c.index for c in cards] == list(range(len(cards)))
    for card in cards:
        assert card.uuid.startswith(("GPU-", "MIG-")) and len(card.uuid) <= 52
        assert card.name and card.memory_mib > 0
        assert card.compute_capability is None or card.compute_capability.count(".") == 1
        assert card.numa_node is None or card.numa_node >= 0


def test_per_process_usage_is_readable(inventory):
    uuids = {c.uuid for c in inventory.cards()}
    for usage in inventory.process_usage():
        assert usage.gpu_uuid in uuids and usage.pid > 0 and usage.used_mib >= 0


HOLD_MEMORY = """
import os, sys, torch
held = torch.empty(1024 * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(os.getpid(), flush=True)
sys.stdin.read()
"""


def test_a_cuda_process_is_listed_with_its_memory(inventory, record_property):
    """A CUDA process (outside MPS) holding 1 GiB on card 0 is listed under its PID on that
    card with at least that much: what the watchdog compares with a quota."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the CUDA process is a torch program)")
    card = inventory.cards()[0]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": card.uuid}
    env["CUDA_MPS_PIPE_DIRECTORY"] = tempfile.mkdtemp(prefix="nomps-")  # no MPS daemon there
    proc = start_client(HOLD_MEMORY, env)
    try:
        pid = int(proc.stdout.readline() or 0)
        assert pid, proc.stderr.read() if proc.poll() is not None else "no PID"
        usage = {u.pid: u for u in inventory.process_usage()}
        assert pid in usage, usage
        record_property("nvml_plain_process_used_mib", usage[pid].used_mib)
        assert usage[pid].gpu_uuid == card.uuid and usage[pid].used_mib >= 1024, usage[pid]
    finally:
        finish(proc)
