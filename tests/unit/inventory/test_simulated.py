"""Pins the inventory seam: simulated cards come from config one by one; the usage
file is re-read on every call and a bad one names the file and entry; a missing
NVML library is a clear error with the fix."""

import json

import pynvml
import pytest

from nodemgr.config.schema import GpuSettings, SimulatedDevice, SimulatedSettings
from nodemgr.errors import InventoryError
from nodemgr.inventory import ProcessUsage, open_inventory


def simulated(tmp_path, usage=None):
    usage_file = tmp_path / "usage.json"
    if usage is not None:
        usage_file.write_text(usage if isinstance(usage, str) else json.dumps(usage))
    devices = (
        SimulatedDevice("GPU-small", "Tesla T4", 15360),
        SimulatedDevice("GPU-big", "A100 80GB", 81920),
    )
    settings = GpuSettings("simulated", SimulatedSettings(devices, str(usage_file)))
    return open_inventory(settings), usage_file


def test_mixed_cards_are_described_one_by_one(tmp_path):
    inventory, _ = simulated(tmp_path)
    cards = inventory.cards()
    assert [(c.index, c.uuid, c.name, c.memory_mib) for c in cards] == [
        (0, "GPU-small", "Tesla T4", 15360),
        (1, "GPU-big", "A100 80GB", 81920),
    ]
    assert cards[0].numa_node is None and cards[0].compute_capability is None


def test_usage_file_is_read_again_on_every_call(tmp_path):
    inventory, usage_file = simulated(tmp_path)
    assert inventory.process_usage() == []  # no file yet: no processes
    usage_file.write_text(
        json.dumps({"processes": [{"pid": 7, "gpu": "GPU-big", "used_mib": 2048}]})
    )
    assert inventory.process_usage() == [ProcessUsage(7, "GPU-big", 2048)]
    usage_file.write_text(json.dumps({"processes": []}))
    assert inventory.process_usage() == []


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "usage.json"),
        ({"procs": []}, 'expected {"processes"'),
        ({"processes": [{"pid": 0, "gpu": "GPU-big", "used_mib": 1}]}, r"processes\[0\].pid"),
        ({"processes": [{"pid": 5, "gpu": "GPU-nope", "used_mib": 1}]}, r"processes\[0\].gpu"),
        ({"processes": [{"pid": 5, "gpu": "GPU-big", "used_mib": -1}]}, r"\[0\].used_mib"),
        ({"processes": [{"pid": True, "gpu": "GPU-big", "used_mib": 1}]}, r"\[0\].pid"),
    ],
)
def test_bad_usage_file_names_file_and_entry(tmp_path, content, problem):
    inventory, _ = simulated(tmp_path, content)
    with pytest.raises(InventoryError, match=problem):
        inventory.process_usage()


def test_nvml_missing_is_a_clear_error_with_the_fix(monkeypatch):
    def no_library():
        raise pynvml.NVMLError_LibraryNotFound(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    with pytest.raises(InventoryError, match="libnvidia-ml.so.1.*gpus.backend: simulated"):
        open_inventory(GpuSettings(backend="nvml"))
