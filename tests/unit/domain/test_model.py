"""Pins nodemgr.domain.model: an Allocation says whether it is whole, how many memory
units and share percent it holds, which cards it is on (from kubelet's own device IDs,
sorted, each once) and its (kind, ID) pairs; ``with_devices`` returns a new allocation
with that kind's IDs sorted, or without the kind when given none; ContainerRef and
CgroupKey print as operators read them; the records are immutable."""

import dataclasses

import pytest

from nodemgr.domain.deviceids import ResourceKind, core_device_id, memory_device_id
from nodemgr.domain.model import Allocation, CgroupKey, ContainerRef

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-1111-1111-1111-111111111111"


def shared(units=4, percent=30, card=GPU_A):
    devices = {}
    if units:
        devices[MEM] = tuple(memory_device_id(card, j) for j in range(units))
    if percent:
        devices[CORE] = tuple(core_device_id(card, j) for j in range(percent))
    return Allocation("ga-1", devices, units * 1024, 1000.0)


def test_a_shared_allocation_counts_its_units_and_share():
    """Memory units and share percent are the numbers of its device IDs."""
    allocation = shared(units=4, percent=30)
    assert (allocation.memory_units, allocation.core_percent) == (4, 30)
    assert allocation.whole is False
    assert allocation.cards == (GPU_A,)


def test_an_allocation_with_one_resource_counts_zero_of_the_other():
    """Memory only: zero share; share only: zero memory."""
    assert shared(percent=0).core_percent == 0
    assert shared(units=0).memory_units == 0
    assert shared(units=0).cards == (GPU_A,)


def test_a_whole_allocation_names_its_cards_sorted():
    """A whole-card allocation is whole, holds no units, and lists its cards sorted."""
    allocation = Allocation("ga-w", {WHOLE: (GPU_B, GPU_A)}, 0, 1000.0)
    assert allocation.whole is True
    assert (allocation.memory_units, allocation.core_percent) == (0, 0)
    assert allocation.cards == (GPU_A, GPU_B)


def test_device_pairs_list_every_kind_and_id():
    """Every (kind, device ID) it holds, one pair per device."""
    allocation = shared(units=2, percent=1)
    assert sorted(allocation.device_pairs()) == sorted(
        [
            (MEM, memory_device_id(GPU_A, 0)),
            (MEM, memory_device_id(GPU_A, 1)),
            (CORE, core_device_id(GPU_A, 0)),
        ]
    )


def test_with_devices_sorts_and_leaves_the_original_alone():
    """with_devices gives a copy holding the IDs sorted; the original is unchanged."""
    original = shared(units=2, percent=0)
    ids = [core_device_id(GPU_A, 2), core_device_id(GPU_A, 0), core_device_id(GPU_A, 1)]
    changed = original.with_devices(CORE, ids)
    assert changed.devices[CORE] == tuple(sorted(ids))
    assert changed.core_percent == 3
    assert CORE not in original.devices
    assert (changed.id, changed.memory_mib, changed.created_at) == ("ga-1", 2048, 1000.0)


def test_with_no_devices_drops_the_kind():
    """Giving a kind no IDs removes it (no empty tuple left behind)."""
    changed = shared(units=2, percent=5).with_devices(CORE, [])
    assert CORE not in changed.devices
    assert changed.core_percent == 0 and changed.memory_units == 2


def test_records_are_immutable():
    """An Allocation cannot be changed in place (the ledger and readers share them)."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        shared().memory_mib = 1  # type: ignore[misc]


def test_container_ref_reads_and_sorts_as_namespace_pod_container():
    """ContainerRef prints as ns/pod/container and orders by those, in that order."""
    a = ContainerRef("ml", "train-0", "main")
    assert str(a) == "ml/train-0/main"
    refs = [
        ContainerRef("ml", "b", "a"),
        ContainerRef("dev", "z", "z"),
        ContainerRef("ml", "a", "z"),
    ]
    assert [str(r) for r in sorted(refs)] == ["dev/z/z", "ml/a/z", "ml/b/a"]


def test_cgroup_key_names_its_hierarchy():
    """A cgroup v2 key reads 'unified:<path>'; a v1 key names its controllers."""
    assert str(CgroupKey("", "/kubepods/pod1/c1")) == "unified:/kubepods/pod1/c1"
    assert str(CgroupKey("memory", "/kubepods/pod1/c1")) == "memory:/kubepods/pod1/c1"


def test_names_from_annotations_and_cgroups_print_safely():
    """A container reference or cgroup holding a line break prints as one line, each odd part
    as an escaped literal; ordinary ones print as they are."""
    assert str(ContainerRef("default", "a", "main")) == "default/a/main"
    assert str(ContainerRef("default", "a\nCRITICAL", "main")) == "default/'a\\nCRITICAL'/main"
    assert str(CgroupKey("", "/kubepods/x\r")) == "unified:'/kubepods/x\\r'"
