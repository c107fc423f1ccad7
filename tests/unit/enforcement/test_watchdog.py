"""Pins the watchdog's acting side in-process, with real processes: a GPU
process on a shared card outside any container is killed with action kill
and only recorded (once per onset, in the ledger too) with action log; the
cards' MPS servers (children of the control daemons) are exempt; a process
on a card given out whole is not its business; a failing usage source
pauses enforcement with one log line; and without the netlink connector the
periodic scan still runs."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.schema import EnforcementSettings
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.enforcement.watchdog import Watchdog
from nodemgr.errors import InventoryError
from nodemgr.inventory import ProcessUsage, open_inventory
from tests.harness.cards import GPU0, GPU1


class Usage:
    """An inventory whose per-process usage the test sets."""

    def __init__(self):
        self.processes: list[ProcessUsage] = []
        self.error: str | None = None

    def process_usage(self):
        if self.error:
            raise InventoryError(self.error)
        return list(self.processes)


@pytest.fixture
def parts(settings):
    ledger = Ledger(settings.state_dir)
    allocator = Allocator(settings, open_inventory(settings.gpus).cards(), ledger)
    registry = ContainerRegistry(ledger, allocator, None)
    yield ledger, allocator, registry
    ledger.close()


def watchdog(parts, usage, action="kill", control_pids=set, events_source=None):
    ledger, allocator, registry = parts
    return Watchdog(
        EnforcementSettings(action=action),
        registry,
        allocator,
        usage,
        ledger,
        control_pids,
        events_source=events_source,
    )


@pytest.fixture
def stray():
    process = subprocess.Popen(["sleep", "1000"])
    yield process
    process.kill()
    process.wait()


def gone(process: subprocess.Popen, seconds: float = 2.0) -> bool:
    try:
        process.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_stray_gpu_process_on_a_shared_card_is_killed(parts, stray):
    usage = Usage()
    usage.processes = [ProcessUsage(stray.pid, GPU0, 300)]
    [violation] = watchdog(parts, usage).scan()
    assert violation.kind == "unallocated" and violation.pids == (stray.pid,)
    assert gone(stray)


def test_action_log_records_each_onset_once_and_kills_nothing(parts, stray, caplog):
    usage = Usage()
    usage.processes = [ProcessUsage(stray.pid, GPU0, 300)]
    dog = watchdog(parts, usage, action="log")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert len(dog.scan()) == 1
    assert not gone(stray, 0.2)
    assert dog.counts["unallocated"] == 1 and dog.kills == 0
    assert sum("violation (unallocated)" in r.getMessage() for r in caplog.records) == 1
    [row] = parts[0].violations()
    assert row["action"] == "log" and row["card"] == GPU0 and row["pids"] == str(stray.pid)
    usage.processes = []  # resolved ...
    assert dog.scan() == []
    usage.processes = [ProcessUsage(stray.pid, GPU0, 300)]  # ... and back: a new onset
    dog.scan()
    assert dog.counts["unallocated"] == 2


def test_mps_servers_of_our_control_daemons_are_exempt(parts):
    # A "control daemon" whose child plays the MPS server.
    control = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '1000'])"]
    )
    try:
        deadline = time.monotonic() + 5
        children = []
        while not children and time.monotonic() < deadline:
            children = [
                int(p)
                for p in open(f"/proc/{control.pid}/task/{control.pid}/children").read().split()
            ]
            time.sleep(0.02)
        [server] = children
        usage = Usage()
        usage.processes = [ProcessUsage(server, GPU0, 500)]
        assert watchdog(parts, usage, control_pids=lambda: {control.pid}).scan() == []
        assert watchdog(parts, usage).scan()[0].pids == (server,)  # not exempt otherwise
    finally:
        control.kill()
        control.wait()


def test_cards_given_out_whole_are_not_watched(parts, stray):
    _, allocator, _ = parts
    allocator.allocate(ResourceKind.WHOLE, [GPU1])
    usage = Usage()
    usage.processes = [ProcessUsage(stray.pid, GPU1, 8000)]
    assert watchdog(parts, usage).scan() == []
    assert not gone(stray, 0.2)


def test_unreadable_usage_pauses_enforcement_with_one_line(parts, caplog):
    usage = Usage()
    usage.error = "NVML: GPU is lost"
    dog = watchdog(parts, usage)
    with caplog.at_level(logging.INFO):
        assert dog.scan() == [] and dog.scan() == []
        usage.error = None
        dog.scan()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("enforcement is paused" in m for m in messages) == 1
    assert any("enforcement resumes" in m for m in messages)


def test_without_process_events_the_periodic_scan_runs(parts, stray, caplog):
    usage = Usage()
    usage.processes = [ProcessUsage(stray.pid, GPU0, 300)]

    def unavailable():
        raise OSError("netlink: operation not permitted")

    dog = watchdog(parts, usage, events_source=unavailable)
    with caplog.at_level(logging.WARNING):
        dog.start()
        try:
            assert gone(stray, 3)
        finally:
            dog.stop()
            assert dog.join(2)
    assert any("periodic scan alone" in r.getMessage() for r in caplog.records)


def test_env_is_read_again_after_the_process_execs_itself(parts, monkeypatch):
    """A process first seen with its quota env, then exec'd without it (same PID,
    same start time) is judged by its new env at the next scan."""
    from nodemgr.domain.model import CgroupKey, Registration
    from nodemgr.enforcement import procfs

    ledger, allocator, registry = parts
    allocator.allocate(ResourceKind.MEMORY, [f"{GPU0}-_-0"])
    [allocation] = allocator.allocations()
    process = subprocess.Popen(["sleep", "1000"])
    try:
        ticks = procfs.read_start_ticks(process.pid)
        registration = Registration("c1", allocation.id, CgroupKey("", "/pod/c1"), 1, 0, None, 0.0)
        monkeypatch.setattr(registry, "registrations", lambda: [registration])
        monkeypatch.setattr(registry, "prune", lambda: None)
        monkeypatch.setattr(procfs, "read_cgroups_text", lambda pid: "0::/pod/c1\n")
        envs = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={allocation.memory_mib}M"}
        monkeypatch.setattr(procfs, "read_gpu_env", lambda pid: dict(envs))
        usage = Usage()
        usage.processes = [ProcessUsage(process.pid, GPU0, 100)]
        dog = watchdog(parts, usage, action="log")
        assert dog.scan() == []
        envs.clear()  # the exec: same PID and start time, no quota env
        [violation] = dog.scan()
        assert violation.kind == "env" and procfs.read_start_ticks(process.pid) == ticks
    finally:
        process.kill()
        process.wait()


def test_stop_wakes_a_blocked_process_event_read(parts):
    """stop() ends the watchdog at once even while it waits on the netlink reader: the
    reader's wake() is called, so SIGTERM does not wait out the read's timeout."""
    from nodemgr.enforcement.procevents import Events

    class BlockingEvents:
        def __init__(self):
            self.woken = threading.Event()
            self.reads = threading.Event()

        def read(self, timeout_seconds):
            self.reads.set()
            self.woken.wait(30)  # far longer than any budget: only wake() ends it
            return Events()

        def wake(self):
            self.woken.set()

        def close(self):
            pass

    source = BlockingEvents()
    dog = watchdog(parts, Usage(), events_source=lambda: source)
    dog.start()
    assert source.reads.wait(5)
    dog.stop()
    assert dog.join(2)
