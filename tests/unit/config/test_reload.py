"""Pins nodemgr.config.reload, what a SIGHUP applies: only RELOADABLE_KEYS take the newly
loaded value and are named as applied; every other changed key keeps its running value
and is named as needing a restart (the daemon never runs half-changed); an unchanged file
changes nothing; every reloadable key names a real setting."""

import dataclasses

from nodemgr.config import reload
from nodemgr.config.loading import settings_from_mapping
from nodemgr.config.schema import Settings

ENV = {"NODE_NAME": "node-a"}


def load(data: object) -> Settings:
    return settings_from_mapping(data, environ=ENV)


def test_reload_applies_only_reloadable_keys_and_keeps_the_rest_running():
    """Reloadable keys take the new value; the rest keep theirs and are named for a restart."""
    running = load({"enforcement": {"action": "kill"}, "resources": {"placement": "binpack"}})
    loaded = load(
        {
            "enforcement": {"action": "log", "grace_mib": 256},
            "kubelet": {"reconcile_interval_seconds": 3},
            "resources": {"placement": "spread", "memory_unit_mib": 512},
        }
    )
    effective, applied, restart = reload.reload_settings(running, loaded)
    assert sorted(applied) == [
        "enforcement.action",
        "enforcement.grace_mib",
        "kubelet.reconcile_interval_seconds",
    ]
    assert sorted(restart) == ["resources.memory_unit_mib", "resources.placement"]
    assert effective.enforcement.action == "log"
    assert effective.enforcement.grace_mib == 256
    assert effective.kubelet.reconcile_interval_seconds == 3
    assert effective.resources == running.resources  # not half-changed


def test_reload_of_the_same_file_changes_nothing():
    """The same settings again: the running ones, nothing applied, nothing to restart."""
    running = load({"mps": {"health_check_interval_seconds": 2}})
    assert reload.reload_settings(running, running) == (running, [], [])


def test_reload_names_a_changed_device_list_as_needing_a_restart():
    """A changed simulated device list is one key needing a restart, not applied."""

    def with_devices(*sizes):
        devices = [
            {"uuid": f"GPU-{i}", "name": "T4", "memory_mib": size} for i, size in enumerate(sizes)
        ]
        return load({"gpus": {"backend": "simulated", "simulated": {"devices": devices}}})

    _, applied, restart = reload.reload_settings(with_devices(100), with_devices(100, 200))
    assert (applied, restart) == ([], ["gpus.simulated.devices"])


def test_a_section_with_both_kinds_of_change_is_split_key_by_key():
    """In one section, the reloadable key is applied and its neighbour kept for a restart."""
    running = load({})
    loaded = load({"kubelet": {"allocation_grace_seconds": 7, "device_plugin_dir": "/elsewhere"}})
    effective, applied, restart = reload.reload_settings(running, loaded)
    assert (applied, restart) == (
        ["kubelet.allocation_grace_seconds"],
        ["kubelet.device_plugin_dir"],
    )
    assert effective.kubelet.allocation_grace_seconds == 7
    assert effective.kubelet.device_plugin_dir == running.kubelet.device_plugin_dir


def test_every_reloadable_key_names_a_real_setting():
    """Each dotted key of RELOADABLE_KEYS resolves to a field of Settings (a typo would make
    a key silently never reloadable)."""
    for key in reload.RELOADABLE_KEYS:
        value = load({})
        for part in key.split("."):
            assert dataclasses.is_dataclass(value), f"{key}: {part} is not in a section"
            assert part in {f.name for f in dataclasses.fields(value)}, f"{key}: no {part}"
            value = getattr(value, part)
