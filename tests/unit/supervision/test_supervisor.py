"""Pins the MPS supervisor against the stand-in control binary: shared cards get a
daemon, EXCLUSIVE_PROCESS and the pinned-memory ceiling; a whole card leaves MPS
only once its clients are gone and returns to DEFAULT; FAULT makes a card
unavailable for shared work without killing anything; control daemons are
adopted, not restarted; the daemon is the verified one (an impostor never is, and a
daemon that cannot be verified makes the card Unhealthy); the watchdog's exemption is
exactly its servers; containers see only its current control socket. While a card does not
answer, a client its daemon waits on at two hung checks in a row is a hold handed to the
watchdog (never our own command, never with the daemon stopped)."""

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from mps import Health, HealthState, MpsLayout
from mps.holders import READING, Connection, Holder, Look
from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.schema import MpsSettings
from nodemgr.domain.deviceids import ResourceKind, card_device_ids
from nodemgr.domain.violations import ControlHold
from nodemgr.inventory import open_inventory
from nodemgr.supervision.supervisor import MpsSupervisor
from standins.cards import GPU0, GPU1, simulated_settings
from standins.clock import Clock
from standins.daemon_proc import MPS_STANDIN, unmount_under

SERVER_FILE = os.path.join(os.path.dirname(MPS_STANDIN), "nvidia-cuda-mps-server")


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
        return MpsSupervisor(mps_settings, layout, inventory, allocator, 1024)

    yield allocator, inventory, supervisor, clock
    for state in supervisor()._states.values():
        pid = state.daemon.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    unmount_under(root)  # the cards' tmpfs and namespaces (as root)
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


def start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[19])


def daemon_in_log(sup, card) -> int:
    """The card's daemon as its own control.log names it (its last start)."""
    with open(os.path.join(sup._states[card].daemon.log_dir, "control.log")) as f:
        return int(re.findall(r"Control +(\d+)\] Starting control daemon", f.read())[-1])


def restart(sup, card) -> None:
    """Kill the card's daemon (a crash) and let the supervisor start another at once."""
    os.kill(daemon_in_log(sup, card), signal.SIGKILL)
    sup.tend_all()  # seen down: Unhealthy, restart after the backoff
    sup._states[card].retry_at = 0.0  # the backoff is not what this test is about
    sup.tend_all()


def test_mps_servers_are_exactly_the_verified_daemons_servers(world):
    """mps_servers names the server the card's daemon started (PID and start time), read
    at the call; not the same server file run by another process."""
    _, _, supervisor, _ = world
    sup = supervisor()
    sup.prepare()
    assert sup.mps_servers() == frozenset()
    client = sup._states[GPU0].daemon.client
    client.command("start_server -uid 0")
    [server] = client.server_pids()
    lookalike = subprocess.Popen(["/bin/sh", SERVER_FILE, str(os.getpid())])
    try:
        assert sup.mps_servers() == {(server, start_time(server))}
    finally:
        lookalike.kill()
        lookalike.wait()


def test_an_impostor_started_first_does_not_become_the_daemon(world, caplog):
    """A process posing with the control binary's name, `-d` and the card's pipe directory
    in its env, started before the daemon's restart (so with the lower PID): the restarted
    daemon is the one set up, and the impostor's children are not MPS servers."""
    _, _, supervisor, _ = world
    sup = supervisor()
    sup.prepare()
    pipe = sup._states[GPU0].daemon.pipe_dir
    impostor = subprocess.Popen(
        [
            "nvidia-cuda-mps-control",
            "-c",
            "import subprocess; subprocess.run(['sleep', '60'])",
            "-d",
        ],
        executable=sys.executable,
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_VISIBLE_DEVICES": GPU0},
    )
    try:
        with caplog.at_level(logging.INFO):
            restart(sup, GPU0)
        real = daemon_in_log(sup, GPU0)
        ready = re.findall(r"GPU0: MPS ready \(control daemon pid (\d+),", caplog.text)
        assert ready == [str(real)] and real != impostor.pid
        assert sup.mps_servers() == frozenset()
    finally:
        impostor.kill()
        impostor.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace")
def test_a_daemon_that_cannot_be_verified_makes_the_card_unhealthy(world):
    """Something else answers at the card's pipe directory: the control binary itself, but
    in a mount namespace of its own (as a container would be). No daemon is verified, so
    its servers could not be told from tenants' processes: the card's shared devices are
    Unhealthy and nothing of it is exempt."""
    allocator, _, supervisor, _ = world
    sup = supervisor()
    daemon = sup._states[GPU0].daemon
    os.makedirs(daemon.pipe_dir)
    foreign = subprocess.Popen(
        ["unshare", "--mount", MPS_STANDIN, "-f"],
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir},
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not daemon.probe().ok and time.monotonic() < deadline:
            time.sleep(0.05)
        sup.prepare()
        assert allocator.card_problems() == {GPU0: "MPS control daemon not verified"}
        view = sup.views()[GPU0]
        assert view.state == "broken" and "outside every container" in view.detail
        daemon.client.command("start_server -uid 0")
        assert sup.mps_servers() == frozenset()
    finally:
        foreign.kill()
        foreign.wait()


def test_containers_get_only_the_daemons_control_socket_renewed_at_each_start(world):
    """The client directory (what containers mount) holds only `control`: the daemon's
    socket, linked again when a restarted daemon makes a new one."""
    _, _, supervisor, _ = world
    sup = supervisor()
    sup.prepare()
    daemon = sup._states[GPU0].daemon
    for _ in range(2):
        assert os.listdir(daemon.client_dir) == ["control"]
        shown = os.path.join(daemon.client_dir, "control")
        assert os.path.samefile(shown, os.path.join(daemon.pipe_dir, "control"))
        restart(sup, GPU0)


# --- cost follows what changes (issue 16) ---------------------------------------------------


def test_a_killed_control_daemon_is_noticed_at_once_not_at_the_next_health_check(world):
    """The health check is an hour away; a kill -9 of a card's control daemon still makes
    its shared devices Unhealthy right away (the supervisor holds a pidfd of each verified
    daemon), and the daemon is started again after the backoff."""
    allocator, inventory, supervisor, clock = world
    sup = supervisor()
    sup._settings = MpsSettings(
        control_binary=MPS_STANDIN, command_timeout_seconds=3, health_check_interval_seconds=3600
    )
    sup.prepare()
    first = sup._states[GPU0].daemon.pid()
    sup.start()
    try:
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while GPU0 not in allocator.card_problems() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "MPS control daemon down" in allocator.card_problems().get(GPU0, "")
        while allocator.card_problems() and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        assert allocator.card_problems() == {}
        assert sup._states[GPU0].daemon.pid() not in (None, first)
    finally:
        sup.stop()
        sup.join(10)


def test_between_health_checks_a_card_change_asks_no_healthy_daemon(world, monkeypatch):
    """A card change wakes the supervisor (a card given out whole must leave MPS at once),
    but the healthy shared cards are not probed for it: no control command runs."""
    allocator, inventory, supervisor, clock = world
    sup = supervisor()
    sup.prepare()
    probes = []
    for state in sup._states.values():
        real = state.daemon.probe
        monkeypatch.setattr(state.daemon, "probe", lambda real=real: probes.append(1) or real())
    sup.tend_all(check=False)
    assert probes == []
    sup.tend_all(check=True)
    assert len(probes) == 2


def test_mps_defaults_a_client_changed_are_restored(world, monkeypatch, caplog):
    """Any client can set the daemon's defaults through the unprivileged socket (a 1M
    pinned limit or a 3 % share for every later server): the health check reads them back
    and restores the card's ceiling and 100 %, saying what it found."""
    allocator, inventory, supervisor, clock = world
    monkeypatch.setattr("nodemgr.supervision.supervisor.DEFAULTS_CHECK_SECONDS", 0.0)
    sup = supervisor()
    sup._settings = MpsSettings(
        control_binary=MPS_STANDIN, command_timeout_seconds=3, health_check_interval_seconds=0.1
    )
    sup.prepare()
    client = sup._states[GPU0].daemon.client
    client.command("set_default_device_pinned_mem_limit 0 1M")
    client.command("set_default_active_thread_percentage 3")
    time.sleep(0.2)
    sup.tend_all()
    assert client.command("get_default_device_pinned_mem_limit 0") == ["15G"]
    assert client.default_active_thread_percentage() == 100.0
    assert "changed through the client socket" in caplog.text


def hung_with(monkeypatch, state, looks: list) -> list:
    """The card's daemon hung at every check; each look returns the next of ``looks``."""
    monkeypatch.setattr(state.daemon, "probe", lambda: Health(HealthState.HUNG, "timed out"))
    seen: list = []

    def look(identity, ours):
        assert ours == os.getpid()
        seen.append(identity)
        return looks.pop(0)

    monkeypatch.setattr(state.daemon, "look", look)
    return seen


def test_a_client_the_daemon_waits_on_at_two_hung_checks_is_handed_to_the_watchdog(
    world, monkeypatch, caplog
):
    """The first hung check finds the daemon waiting on a tenant's connection: named in the
    card's problem and looked at again at once (the next wake is now); the second finds
    the same one: a hold, handed to the watchdog and logged; once the daemon answers, the
    hold is gone and the card Healthy."""
    allocator, inventory, supervisor, clock = world
    sup = supervisor()
    sup.prepare()
    state = sup._states[GPU0]
    daemon = state.identity
    waited = Connection(4, 10, 11, 0, READING, (Holder(4242, 99),))
    seen = hung_with(monkeypatch, state, [Look(daemon, False, (waited,)) for _ in range(2)])
    sup.tend_all()
    assert sup.control_holds() == () and seen == [daemon]
    assert "MPS control daemon not answering" in allocator.card_problems()[GPU0]
    assert "waited on: process 4242" in sup.views()[GPU0].detail
    assert sup._next_wake(time.monotonic() + 3600) <= time.monotonic()
    with caplog.at_level(logging.ERROR):
        sup.tend_all(check=False)
    assert sup.control_holds() == (ControlHold(GPU0, 10, 11, ((4242, 99),)),)
    assert "held: process 4242" in sup.views()[GPU0].detail
    assert any("waits on process(es) 4242" in r.getMessage() for r in caplog.records)
    assert sup._next_wake(time.monotonic() + 3600) > time.monotonic() + 3000
    monkeypatch.undo()
    sup.tend_all()
    assert sup.control_holds() == () and GPU0 not in allocator.card_problems()


def test_our_own_commands_a_stopped_daemon_and_an_incomplete_look_are_no_holds(
    world, monkeypatch, caplog
):
    """Our own control command holding the connection, a stopped daemon (SIGSTOP) and a
    look that could not see everything: no hold, nothing looked at again; an incomplete
    look says why, once."""
    allocator, inventory, supervisor, clock = world
    sup = supervisor()
    sup.prepare()
    state = sup._states[GPU0]
    daemon = state.identity
    ours = Connection(4, 10, 11, 0, READING, (Holder(4242, 99, ours=True),))
    tenant = Connection(4, 10, 11, 0, READING, (Holder(4242, 99),))
    looks = [
        Look(daemon, False, (ours,)),
        Look(daemon, False, (ours,)),
        Look(daemon, True, (tenant,)),
        Look(daemon, True, (tenant,)),
        Look(daemon, False, (), "sock_diag refused"),
        Look(daemon, False, (), "sock_diag refused"),
    ]
    hung_with(monkeypatch, state, looks)
    with caplog.at_level(logging.WARNING):
        for _ in range(6):
            sup.tend_all()
            assert sup.control_holds() == () and not state.relook
    said = [r.getMessage() for r in caplog.records if "cannot be told" in r.getMessage()]
    assert len(said) == 1 and "sock_diag refused" in said[0]
