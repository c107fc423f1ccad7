"""Pins the MPS supervisor against the stand-in control binary: shared cards get a
daemon, EXCLUSIVE_PROCESS and the pinned-memory ceiling; a whole card leaves MPS
only once its clients are gone and returns to DEFAULT; FAULT makes a card
unavailable for shared work without killing anything; control daemons are
adopted, not restarted."""

import os
import shutil
import signal
import tempfile

import pytest

from mps import MpsLayout
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.schema import MpsSettings
from nodemgr.domain.deviceids import ResourceKind, card_device_ids
from nodemgr.inventory import open_inventory
from nodemgr.supervision.supervisor import MpsSupervisor
from tests.harness.cards import GPU0, GPU1, simulated_settings
from tests.harness.clock import Clock
from tests.harness.daemon_proc import MPS_STANDIN


@pytest.fixture
def world():
    root = tempfile.mkdtemp(prefix="sup-", dir="/tmp")  # short: unix socket paths
    settings = simulated_settings(root)
    mps_settings = MpsSettings(control_binary=MPS_STANDIN, command_timeout_seconds=3)
    layout = MpsLayout(settings.run_dir)
    inventory = open_inventory(settings.gpus)
    clock = Clock()
    allocator = Allocator(
        settings, inventory.cards(), Ledger(settings.state_dir), clock=clock, mps_layout=layout
    )

    def supervisor():
        sup = MpsSupervisor(mps_settings, layout, inventory, allocator, 1024)
        sup._ensure_shm = lambda: None  # no tmpfs mount needed for these tests
        return sup

    yield allocator, inventory, supervisor, clock
    for state in supervisor()._states.values():
        pid = state.daemon.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def test_shared_cards_run_mps_with_exclusive_process_and_ceiling(world):
    """Shared cards run MPS in EXCLUSIVE_PROCESS with the card's memory as the pinned
    ceiling, read back as the real control binary answers it (15360M reads 15G)."""
    allocator, inventory, supervisor, clock = world
    sup = supervisor()
    sup.prepare()
    assert inventory.compute_modes == {GPU0: "EXCLUSIVE_PROCESS", GPU1: "EXCLUSIVE_PROCESS"}
    for card in (GPU0, GPU1):
        client = sup._states[card].daemon.client
        assert client.command("get_default_device_pinned_mem_limit 0") == ["15G"]
    assert allocator.card_problems() == {}


def test_whole_card_leaves_mps_only_when_its_clients_are_gone(world):
    allocator, inventory, supervisor, clock = world
    sup = supervisor()
    sup.prepare()
    client = sup._states[GPU1].daemon.client
    client.command("start_server -uid 0")
    [server] = client.server_pids()
    client.command(f"sim_add_client {server} 4242")
    allocator.allocate(ResourceKind.WHOLE, [GPU1])
    sup.tend_all()
    assert sup._states[GPU1].daemon.pid() is not None  # clients still run: MPS stays
    assert inventory.compute_modes[GPU1] == "EXCLUSIVE_PROCESS"
    client.command(f"terminate_client {server} 4242")
    sup.tend_all()
    assert sup._states[GPU1].daemon.pid() is None
    assert inventory.compute_modes == {GPU0: "EXCLUSIVE_PROCESS", GPU1: "DEFAULT"}
    # Freed (kubelet stopped reporting it, past the grace period): back to MPS.
    clock.now += 120
    allocator.reconcile({})
    sup.tend_all()
    assert sup._states[GPU1].daemon.pid() is not None
    assert inventory.compute_modes[GPU1] == "EXCLUSIVE_PROCESS"


def test_fault_marks_the_card_unavailable_and_kills_nothing(world):
    allocator, _, supervisor, _ = world
    sup = supervisor()
    sup.prepare()
    client = sup._states[GPU0].daemon.client
    client.command("start_server -uid 0")
    [server] = client.server_pids()
    client.command(f"sim_set_server_status {server} FAULT")
    sup.tend_all()
    assert allocator.card_problems() == {GPU0: "MPS server in FAULT"}
    memory = {d.id: d.healthy for d in allocator.devices(ResourceKind.MEMORY)}
    assert not memory[card_device_ids(ResourceKind.MEMORY, GPU0, 1)[0]]
    assert memory[card_device_ids(ResourceKind.MEMORY, GPU1, 1)[0]]
    assert client.server_pids() == [server]  # the server was not touched
    client.command(f"sim_set_server_status {server} ACTIVE")
    sup.tend_all()
    assert allocator.card_problems() == {}


def test_a_second_supervisor_adopts_instead_of_restarting(world):
    _, _, supervisor, _ = world
    first = supervisor()
    first.prepare()
    pids = {card: first._states[card].daemon.pid() for card in (GPU0, GPU1)}
    second = supervisor()
    second.prepare()
    assert {card: second._states[card].daemon.pid() for card in (GPU0, GPU1)} == pids
