"""Pins how the watchdog acts on the processes holding a card's MPS control daemon (the holds
the MPS supervisor names), with real processes: a process in a container (here: a mount
namespace of its own) is killed with action kill and only reported with log, once per onset,
in the ledger and to the Event callback; a process of the host's is named and never killed;
a holder that is gone, or whose PID is another process's now, is not acted on; holds are
judged even while per-process GPU memory cannot be read; a container holding again through
another connection within HOLD_REPEAT_SECONDS loses its init process too."""

from __future__ import annotations

import logging
import shutil
import subprocess

import pytest

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.schema import EnforcementSettings
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.domain.violations import MPS_CONTROL, ControlHold
from nodemgr.enforcement import procfs
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.enforcement.watchdog import Watchdog
from nodemgr.errors import InventoryError
from nodemgr.inventory import open_inventory
from standins.cards import GPU0


class Usage:
    """An inventory without GPU processes (or whose usage cannot be read)."""

    error: str | None = None

    def process_usage(self):
        if self.error:
            raise InventoryError(self.error)
        return []


@pytest.fixture
def parts(settings):
    ledger = Ledger(settings.state_dir)
    allocator = Allocator(settings, open_inventory(settings.gpus).cards(), ledger)
    yield ledger, allocator, ContainerRegistry(ledger, allocator, None)
    ledger.close()


@pytest.fixture
def started():
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait()


def spawn(started, *argv: str) -> subprocess.Popen:
    process = subprocess.Popen(list(argv))
    started.append(process)
    return process


def in_own_mount_ns(started) -> int:
    """A process in a mount namespace of its own (as every container's is); its PID."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    process = spawn(started, "unshare", "-m", "--propagation", "private", "sleep", "1000")
    for _ in range(200):
        if procfs.in_our_mount_ns(process.pid) is False:
            return process.pid
        subprocess.run(["sleep", "0.01"])
    pytest.skip("cannot make a mount namespace here (needs root)")


def hold_of(*pids: int) -> ControlHold:
    return ControlHold(GPU0, 10, 11, tuple((pid, procfs.read_start_ticks(pid)) for pid in pids))


def watchdog(parts, holds, action="kill", usage=None, events=None) -> Watchdog:
    ledger, allocator, registry = parts
    return Watchdog(
        EnforcementSettings(action=action),
        registry,
        allocator,
        usage or Usage(),
        ledger,
        on_violation=(lambda v, card, act: events.append((v, act))) if events is not None else None,
        control_holds=lambda: holds,
    )


def gone(process: subprocess.Popen, seconds: float = 2.0) -> bool:
    try:
        process.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_a_container_process_holding_the_control_daemon_is_killed(parts, started, caplog):
    """Action kill: killed, reported once (log line, ledger row, Event callback), counted."""
    pid = in_own_mount_ns(started)
    [process] = [p for p in started if p.pid == pid]
    events: list = []
    dog = watchdog(parts, [hold_of(pid)], events=events)
    with caplog.at_level(logging.WARNING):
        [violation] = dog.scan()
    assert violation.kind == MPS_CONTROL and violation.pids == (pid,)
    assert gone(process)
    assert dog.counts[MPS_CONTROL] == 1 and dog.kills == 1
    assert dog.summary()["violations"][MPS_CONTROL] == 1
    [row] = parts[0].violations()
    assert row["kind"] == MPS_CONTROL and row["pids"] == str(pid) and row["card"] == GPU0
    assert [(v.kind, act) for v, act in events] == [(MPS_CONTROL, "kill")]
    assert any(
        f"killed process {pid} (mps_control violation" in r.getMessage() for r in caplog.records
    )


def test_with_action_log_a_holder_is_reported_once_and_runs_on(parts, started):
    """Action log: the same hold at three scans is one onset, and nothing is killed."""
    pid = in_own_mount_ns(started)
    [process] = [p for p in started if p.pid == pid]
    dog = watchdog(parts, [hold_of(pid)], action="log")
    for _ in range(3):
        assert [v.pids for v in dog.scan()] == [(pid,)]
    assert not gone(process, 0.2)
    assert dog.counts[MPS_CONTROL] == 1 and dog.kills == 0


def test_a_host_process_holding_it_is_named_never_killed(parts, started, caplog):
    """A process in our mount namespace and in no registered container: named as the
    host's in the violation, nothing to kill even with action kill."""
    host = spawn(started, "sleep", "1000")
    dog = watchdog(parts, [hold_of(host.pid)])
    with caplog.at_level(logging.WARNING):
        [violation] = dog.scan()
    assert violation.pids == () and violation.owner is None
    assert not gone(host, 0.2) and dog.kills == 0
    [line] = [r.getMessage() for r in caplog.records if "violation (mps_control)" in r.getMessage()]
    assert f"process {host.pid} (in no container" in line and "not killed" in line


def test_a_holder_that_is_gone_or_another_process_now_is_not_acted_on(parts, started):
    """The start time named with the hold must still be the process's: a PID since reused
    is spared, and a hold whose holders are all gone is no violation."""
    pid = in_own_mount_ns(started)
    [process] = [p for p in started if p.pid == pid]
    reused = ControlHold(GPU0, 10, 11, ((pid, procfs.read_start_ticks(pid) + 1),))
    assert watchdog(parts, [reused]).scan() == []
    assert not gone(process, 0.2)


def test_holds_are_judged_while_gpu_memory_cannot_be_read(parts, started):
    """NVML failing pauses the memory checks, not the control holds."""
    pid = in_own_mount_ns(started)
    [process] = [p for p in started if p.pid == pid]
    usage = Usage()
    usage.error = "NVML: GPU is lost"
    [violation] = watchdog(parts, [hold_of(pid)], usage=usage).scan()
    assert violation.kind == MPS_CONTROL and gone(process)


def test_a_container_holding_again_loses_its_init_process(parts, started, monkeypatch):
    """A registered container's process holds MPS and is killed; a new process of the
    same container holds it again through another connection (a loop): that one and the
    container's init process are killed, so the container stops. The same hold seen at a
    later scan is not a repeat of itself."""
    from nodemgr.domain.model import CgroupKey, Registration

    ledger, allocator, registry = parts
    allocator.allocate(ResourceKind.MEMORY, [f"{GPU0}-_-0"])
    [allocation] = allocator.allocations()
    init = spawn(started, "sleep", "1000")
    init_ticks = procfs.read_start_ticks(init.pid)
    registration = Registration(
        "c1", allocation.id, CgroupKey("", "/pod/c1"), init.pid, init_ticks, None, 0.0
    )
    monkeypatch.setattr(registry, "registrations", lambda: [registration])
    monkeypatch.setattr(registry, "prune", lambda: None)
    monkeypatch.setattr(procfs, "read_cgroups_text", lambda pid: "0::/pod/c1\n")
    first, second = spawn(started, "sleep", "1000"), spawn(started, "sleep", "1000")
    holds = [hold_of(first.pid)]
    dog = watchdog(parts, holds, action="log")
    for _ in range(3):  # one hold at three scans: never a repeat of itself
        assert [v.pids for v in dog.scan()] == [(first.pid,)]
    holds[:] = [ControlHold(GPU0, 20, 21, ((second.pid, procfs.read_start_ticks(second.pid)),))]
    [violation] = dog.scan()
    assert violation.pids == (second.pid, init.pid)
    assert f"its init process {init.pid} too" in violation.detail
    dog.set_settings(EnforcementSettings(action="kill"))
    dog.scan()
    assert gone(second) and gone(init) and not gone(first, 0.1)
