"""nodemgr.status.nodefacts: which cards have a kernel dmem region, read from files laid out
as the kernel and NVIDIA's driver lay them out (a cgroup root and /proc/driver/nvidia/gpus
in a temporary directory).

Pins: a region is found only when the root's cgroup.controllers lists ``dmem`` AND
dmem.capacity names the card's PCI address (taken from the driver's ``GPU UUID:`` line);
anything missing or unreadable means no region, never a guess.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nodemgr.status.nodefacts import dmem_regions
from standins.cards import GPU0, GPU1

INFORMATION = """Model: \t\t Tesla T4
IRQ:   \t\t 64
GPU UUID: \t {uuid}
Video BIOS: \t 90.04.96.00.01
Bus Type: \t PCIe
Device Minor: \t {minor}
"""


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, Path]:
    """A cgroup root with dmem enabled and one region, and the driver's files of two cards."""
    cgroup, gpus = tmp_path / "cgroup", tmp_path / "gpus"
    cgroup.mkdir()
    (cgroup / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma dmem\n")
    (cgroup / "dmem.capacity").write_text("drm/0000:3b:00.0/vram0 16106127360\n")
    for minor, (address, uuid) in enumerate((("0000:3b:00.0", GPU0), ("0000:af:00.0", GPU1))):
        (gpus / address).mkdir(parents=True)
        (gpus / address / "information").write_text(INFORMATION.format(uuid=uuid, minor=minor))
    return cgroup, gpus


def test_a_card_with_a_region_is_found_by_its_pci_address(node):
    """GPU0's PCI address is in dmem.capacity: its region; GPU1 has none."""
    cgroup, gpus = node
    assert dmem_regions([GPU0, GPU1], str(cgroup), str(gpus)) == {GPU0: "drm/0000:3b:00.0/vram0"}


def test_no_dmem_controller_means_no_region(node):
    """A kernel without the dmem controller (or not enabled at the root): nothing, even
    with a capacity file present."""
    cgroup, gpus = node
    (cgroup / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert dmem_regions([GPU0], str(cgroup), str(gpus)) == {}


@pytest.mark.parametrize("broken", ["no capacity", "no driver files", "no uuid line"])
def test_missing_facts_claim_nothing(node, broken):
    """No dmem.capacity, no /proc/driver/nvidia/gpus, or a driver file without the UUID:
    no region (never matched by guess)."""
    cgroup, gpus = node
    if broken == "no capacity":
        (cgroup / "dmem.capacity").unlink()
    elif broken == "no driver files":
        gpus = gpus / "absent"
    else:
        (gpus / "0000:3b:00.0" / "information").write_text("Model: Tesla T4\n")
    assert dmem_regions([GPU0], str(cgroup), str(gpus)) == {}


def test_a_region_of_another_device_is_not_this_cards(node):
    """A region whose name only contains the address as a substring of something else is
    not the card's: the address must be a whole path component."""
    cgroup, gpus = node
    (cgroup / "dmem.capacity").write_text("drm/10000:3b:00.0/vram0 1\n")
    assert dmem_regions([GPU0], str(cgroup), str(gpus)) == {}
