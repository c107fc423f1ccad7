"""Pins the MPS supervisor's /dev/shm per card, against the stand-in control binary and real
tmpfs mounts and mount namespaces (root): each card's tmpfs sized by mps.shm_size_mib and
its daemon started with that tmpfs as /dev/shm; the node-wide tmpfs of earlier versions
unmounted; a daemon on the host's /dev/shm replaced once it has no clients; a card's
tmpfs emptied once it holds no shared allocation (an idle MPS server stopped first, its
daemon started again), never while it holds one or while the server has clients; a card
without its tmpfs takes no shared work; without root, plain directories."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile

import pytest

from mps import CardDaemon, MpsLayout, mounts, proc, shm
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.schema import MpsSettings
from nodemgr.domain.deviceids import ResourceKind, card_device_ids
from nodemgr.inventory import open_inventory
from nodemgr.supervision.supervisor import MIN_SHM_MIB, MpsSupervisor, card_shm_mib
from standins.cards import GPU0, GPU1, simulated_settings
from standins.clock import Clock
from standins.daemon_proc import MPS_STANDIN, unmount_under

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="tmpfs mounts and namespaces need root")
SIZE_MIB = 16


@pytest.fixture
def world():
    root = tempfile.mkdtemp(prefix="shs-", dir="/tmp")  # short: unix socket paths
    settings = simulated_settings(root)
    layout = MpsLayout(settings.run_dir)
    inventory = open_inventory(settings.gpus)
    clock = Clock()
    allocator = Allocator(
        settings, inventory.cards(), Ledger(settings.state_dir), clock=clock, mps_layout=layout
    )
    mps_settings = MpsSettings(
        control_binary=MPS_STANDIN, command_timeout_seconds=3, shm_size_mib=SIZE_MIB
    )

    def supervisor(**options):
        return MpsSupervisor(mps_settings, layout, inventory, allocator, 1024, **options)

    yield layout, allocator, supervisor, clock
    for pid in proc.pids():
        environ = proc.read_file(f"/proc/{pid}/environ", 1 << 20) or b""
        if f"CUDA_MPS_PIPE_DIRECTORY={layout.root}/".encode() in environ:
            os.kill(pid, signal.SIGKILL)
    unmount_under(root)
    shutil.rmtree(root, ignore_errors=True)


def write(path: str, text: str = "x") -> None:
    with open(path, "w") as f:
        f.write(text)


def share(allocator: Allocator, card: str):
    """A shared allocation of 4 GiB on ``card``."""
    return allocator.allocate(
        ResourceKind.MEMORY, card_device_ids(ResourceKind.MEMORY, card, 15)[:4]
    )


def release_all(allocator: Allocator, clock: Clock) -> None:
    """kubelet reports none of them any more, past the grace period."""
    clock.now += 120
    allocator.reconcile({})


def test_each_card_gets_the_setting_or_its_share_of_half_the_memory():
    """mps.shm_size_mib is each card's size; 0 is half of the memory shared out among the
    cards, never below MIN_SHM_MIB."""
    assert card_shm_mib(4096, 64 * 2**30, 8) == 4096
    assert card_shm_mib(0, 64 * 2**30, 8) == 4096
    assert card_shm_mib(0, 64 * 2**30, 1) == 32768
    assert card_shm_mib(0, 2**30, 16) == MIN_SHM_MIB


@needs_root
def test_each_card_has_its_own_tmpfs_and_its_daemon_has_it_as_dev_shm(world):
    """After prepare: two tmpfs of SIZE_MIB, and each daemon's /dev/shm is its card's."""
    layout, _, supervisor, _ = world
    sup = supervisor()
    sup.prepare()
    devices = set()
    for card in (GPU0, GPU1):
        path = layout.shm_dir(card)
        assert shm.is_tmpfs(path) and shm.sized(path)[0] == SIZE_MIB * 2**20
        state = sup._states[card]
        assert state.identity is not None
        assert os.stat(f"/proc/{state.identity.pid}/root/dev/shm").st_dev == shm.device(path)
        devices.add(shm.device(path))
    assert len(devices) == 2


@needs_root
def test_the_node_wide_tmpfs_of_earlier_versions_is_unmounted_at_start(world, caplog):
    """<run_dir>/mps/shm, mounted as an earlier version left it: unmounted and removed."""
    layout, _, supervisor, _ = world
    shm.mount(layout.retired_shm_dir, SIZE_MIB)
    with caplog.at_level(logging.WARNING):
        supervisor().prepare()
    assert mounts.top_mount(layout.retired_shm_dir) is None
    assert not os.path.exists(layout.retired_shm_dir)
    assert "shared between every card's containers" in caplog.text


@needs_root
def test_a_daemon_on_the_hosts_dev_shm_is_replaced_once_it_has_no_clients(world, caplog):
    """A daemon an earlier version started (our namespace, the host's /dev/shm) is adopted;
    with a client it serves on (said once), without one it is quit and one on the card's
    tmpfs takes its place."""
    layout, allocator, supervisor, _ = world
    old = CardDaemon(GPU0, MPS_STANDIN, layout.pipe_dir(GPU0), layout.log_dir(GPU0), 3)
    old.start()
    old.client.command("start_server -uid 0")
    [server] = old.client.server_pids()
    old.client.command(f"sim_add_client {server} 4242")
    before = old.pid()
    sup = supervisor()
    with caplog.at_level(logging.WARNING):
        sup.prepare()
        sup.tend_all()
    assert sup._states[GPU0].identity.pid == before
    assert caplog.text.count("runs with the host's /dev/shm, not the card's tmpfs") == 1
    assert allocator.card_problems() == {}
    old.client.command(f"terminate_client {server} 4242")
    sup.tend_all()
    identity = sup._states[GPU0].identity
    assert identity is not None and identity.pid != before
    assert sup._states[GPU0].daemon.on_card_shm(identity) is True
    assert allocator.card_problems() == {}


@needs_root
def test_a_cards_tmpfs_is_emptied_once_it_holds_no_shared_allocation(world):
    """Files in both cards' tmpfs: the idle card's go at the next tend, the shared card's
    stay while its allocation lives and go once it is released."""
    layout, allocator, supervisor, clock = world
    sup = supervisor()
    sup.prepare()
    share(allocator, GPU0)
    for card in (GPU0, GPU1):
        os.makedirs(f"{layout.shm_dir(card)}/d/e")
        write(f"{layout.shm_dir(card)}/d/e/torch_1_secret")
    sup.tend_all()
    assert os.listdir(layout.shm_dir(GPU0)) == ["d"]
    assert os.listdir(layout.shm_dir(GPU1)) == []
    release_all(allocator, clock)
    sup.tend_all()
    assert os.listdir(layout.shm_dir(GPU0)) == []


@needs_root
def test_an_idle_mps_server_is_stopped_before_emptying_a_busy_one_is_not(world, caplog):
    """An MPS server with a client on an idle card: nothing emptied, same daemon. Its client
    gone: the daemon (and its server) is stopped, the tmpfs emptied, a daemon started
    again; the card stays Healthy."""
    layout, allocator, supervisor, clock = world
    sup = supervisor()
    sup.prepare()
    share(allocator, GPU0)
    sup.tend_all()
    client = sup._states[GPU0].daemon.client
    client.command("start_server -uid 0")
    [server] = client.server_pids()
    client.command(f"sim_add_client {server} 4242")
    write(f"{layout.shm_dir(GPU0)}/server-file")
    release_all(allocator, clock)
    before = sup._states[GPU0].identity
    sup.tend_all()
    assert os.listdir(layout.shm_dir(GPU0)) == ["server-file"]
    assert sup._states[GPU0].identity == before
    client.command(f"terminate_client {server} 4242")
    with caplog.at_level(logging.INFO):
        sup.tend_all()
    after = sup._states[GPU0].identity
    assert after is not None and after != before
    assert os.listdir(layout.shm_dir(GPU0)) == []
    assert sup._states[GPU0].daemon.client.server_pids() == []
    assert "stopping its idle MPS server" in caplog.text
    assert allocator.card_problems() == {}


@needs_root
def test_a_card_without_its_tmpfs_takes_no_shared_work(world):
    """GPU1's tmpfs cannot be mounted (a file is where its directory goes): its shared
    devices are Unhealthy, saying why; GPU0 is served."""
    layout, allocator, supervisor, _ = world
    os.makedirs(os.path.dirname(layout.shm_dir(GPU1)))
    write(layout.shm_dir(GPU1))
    supervisor().prepare()
    assert allocator.card_problems() == {GPU1: "no /dev/shm tmpfs"}


def test_without_root_the_shm_directories_are_plain_and_the_daemons_ours(world, caplog):
    """isolate_shm False (not root): 1777 directories, no mount, daemons in our namespace."""
    layout, allocator, supervisor, _ = world
    sup = supervisor(isolate_shm=False)
    with caplog.at_level(logging.WARNING):
        sup.prepare()
    for card in (GPU0, GPU1):
        assert os.stat(layout.shm_dir(card)).st_mode & 0o7777 == 0o1777
        assert mounts.top_mount(layout.shm_dir(card)) is None
        identity = sup._states[card].identity
        assert proc.mount_ns(identity.pid) == proc.mount_ns("self")
    assert "not running as root" in caplog.text
    assert allocator.card_problems() == {}
