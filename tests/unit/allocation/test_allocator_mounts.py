"""Pins what nodemgr.allocation.allocator gives a shared container to mount, and the lock
the MPS supervisor empties an idle card's /dev/shm tmpfs under: each card's shared
containers get that card's client directory (read-only), never another card's, from both
resources, and no /dev/shm (their runtime's own serves; the card's tmpfs is its MPS
daemon's and server's); whole cards get no mount;
``while_idle`` runs only while the card holds no shared allocation, and admission waits
for it."""

import threading
import time

import pytest

from mps import MpsLayout
from nodemgr.allocation.allocator import Allocator, shared_mounts
from nodemgr.allocation.ledger import Ledger
from nodemgr.domain.deviceids import ResourceKind, card_device_ids
from nodemgr.domain.model import Mount
from nodemgr.inventory import open_inventory
from standins.cards import GPU0, GPU1, simulated_settings
from standins.clock import Clock

MEM, CORE, WHOLE = ResourceKind.MEMORY, ResourceKind.CORE, ResourceKind.WHOLE


@pytest.fixture
def world(tmp_path):
    settings = simulated_settings(str(tmp_path))
    layout = MpsLayout(settings.run_dir)
    cards = open_inventory(settings.gpus).cards()
    clock = Clock()
    allocator = Allocator(
        settings, cards, Ledger(settings.state_dir), clock=clock, mps_layout=layout
    )
    return allocator, layout, clock


def test_a_shared_container_mounts_only_its_own_cards_client_directory(world):
    """Card 0's and card 1's containers each get their own card's client directory,
    read-only, from memory and from share alike, and nothing at /dev/shm: neither their
    card's tmpfs (its MPS daemon's and server's) nor <run_dir>/mps/shm."""
    allocator, layout, _ = world
    for card in (GPU0, GPU1):
        expected = (Mount("/tmp/nvidia-mps", layout.client_dir(card), read_only=True),)
        memory = allocator.allocate(MEM, card_device_ids(MEM, card, 15)[:2])
        core = allocator.allocate(CORE, card_device_ids(CORE, card, 15)[:10])
        assert memory.mounts == core.mounts == expected
        assert "/dev/shm" not in {m.container_path for m in memory.mounts}


def test_a_whole_card_gets_no_mount(world):
    allocator, _, _ = world
    assert allocator.allocate(WHOLE, [GPU1]).mounts == ()


def test_without_mps_there_is_no_mount():
    """MPS off (no layout): no client directory."""
    assert shared_mounts(None, GPU0) == ()


def test_while_idle_runs_only_while_the_card_holds_no_shared_allocation(world):
    """Idle: the action runs and its result comes back. Holding shared work: None, not run;
    the other card is idle still; a whole card counts as idle (its containers use no MPS)."""
    allocator, _, clock = world
    assert allocator.while_idle(GPU0, lambda: "ran") == "ran"
    allocator.allocate(MEM, card_device_ids(MEM, GPU0, 15)[:2])
    ran = []
    assert allocator.while_idle(GPU0, lambda: ran.append(1)) is None and ran == []
    assert allocator.while_idle(GPU1, lambda: "ran") == "ran"
    allocator.allocate(WHOLE, [GPU1])
    assert allocator.while_idle(GPU1, lambda: "ran") == "ran"
    assert allocator.shared_cards() == {GPU0}
    clock.now += 120
    allocator.reconcile({})
    assert allocator.while_idle(GPU0, lambda: "ran") == "ran"


def test_admission_waits_for_the_action(world):
    """An Allocate that comes while the action runs returns only after it."""
    allocator, _, _ = world
    events: list[str] = []
    started = threading.Event()

    def action():
        started.set()
        time.sleep(0.3)
        events.append("emptied")

    runner = threading.Thread(target=allocator.while_idle, args=(GPU0, action))
    runner.start()
    started.wait(5)
    allocator.allocate(MEM, card_device_ids(MEM, GPU0, 15)[:2])
    events.append("allocated")
    runner.join()
    assert events == ["emptied", "allocated"]
