"""Pins the daemon's start-up checks: a memory unit so small that kubelet could not
read the device list is refused, naming the key and a working value."""

import pytest

from nodemgr.daemon import check_device_list_size
from nodemgr.errors import ConfigError
from nodemgr.inventory import Card

A100 = [Card(i, f"GPU-{i:08d}-0000-4000-8000-000000000000", "A100 80GB", 81920) for i in range(8)]


def test_mib_units_on_big_cards_are_refused_with_the_fix():
    with pytest.raises(ConfigError) as refused:
        check_device_list_size(A100, 1)
    assert refused.value.key == "resources.memory_unit_mib"
    assert "655360 memory devices" in refused.value.problem
    assert "use 1024" in refused.value.problem


def test_gib_units_pass_on_the_same_cards():
    check_device_list_size(A100, 1024)
    check_device_list_size(A100, 128)  # 5120 devices: well within kubelet's limit
