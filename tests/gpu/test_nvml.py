"""On a machine with an NVIDIA GPU (``pytest -m gpu``): the NVML backend reads real
cards, facts a board lacks are None rather than errors, and per-process usage works.
Skipped where NVML cannot initialise (no driver), with the reason."""

import pytest

from nodemgr.config.schema import GpuSettings
from nodemgr.errors import InventoryError
from nodemgr.inventory import open_inventory

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
