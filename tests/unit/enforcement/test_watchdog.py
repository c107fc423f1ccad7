"""Pins the watchdog's acting side in-process, with real processes: a GPU
process on a shared card outside any container is killed with action kill
and only recorded (once per onset, in the ledger too) with action log; exactly
the MPS servers the supervisor names (PID and start time) are exempt; a stray process
on a card given out whole is killed too; a failing usage source, /proc
unreadable for want of a descriptor, or a kill that cannot be done fail the scan
closed (nobody judged on half a picture; a problem that makes the daemon unhealthy,
logged once, cleared by the next scan that judges); and without the netlink
connector the periodic scan still runs. One hostile process never stops it: a process in a cgroup
named with 0xff is unallocated (fail closed) while the scan goes on, its exec does not
end the thread, an unreadable environ is an env violation counted once, a failing report
spares no offender, and a run that still dies is restarted."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.schema import EnforcementSettings
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.enforcement import procfs
from nodemgr.enforcement.registry import ContainerRegistry
from nodemgr.enforcement.watchdog import Watchdog
from nodemgr.errors import InventoryError
from nodemgr.inventory import ProcessUsage, open_inventory
from standins.cards import GPU0, GPU1
from standins.fdexhaust import no_descriptors_left


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


def watchdog(parts, usage, action="kill", mps_servers=frozenset, events_source=None):
    ledger, allocator, registry = parts
    return Watchdog(
        EnforcementSettings(action=action),
        registry,
        allocator,
        usage,
        ledger,
        mps_servers,
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


def test_exactly_the_named_mps_servers_are_exempt(parts):
    """The watchdog spares exactly the (PID, start time) pairs the MPS supervisor names
    (the servers of the verified control daemons): not that PID with another start time
    (reused), not a child of a named process (no ancestry rule: a tenant's process can
    descend from anything it started itself)."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '1000'])"]
    )
    try:
        deadline = time.monotonic() + 5
        children = []
        while not children and time.monotonic() < deadline:
            with open(f"/proc/{server.pid}/task/{server.pid}/children") as f:
                children = [int(p) for p in f.read().split()]
            time.sleep(0.02)
        [child] = children
        named = {(server.pid, procfs.read_start_ticks(server.pid))}
        usage = Usage()
        usage.processes = [ProcessUsage(server.pid, GPU0, 500)]
        assert watchdog(parts, usage, "log", mps_servers=lambda: named).scan() == []
        reused = {(pid, ticks + 1) for pid, ticks in named}
        [violation] = watchdog(parts, usage, "log", mps_servers=lambda: reused).scan()
        assert violation.pids == (server.pid,)
        usage.processes = [ProcessUsage(child, GPU0, 500)]
        [violation] = watchdog(parts, usage, "log", mps_servers=lambda: named).scan()
        assert violation.pids == (child,)
    finally:
        server.kill()
        server.wait()


def test_a_stray_process_on_a_card_given_out_whole_is_killed(parts, stray):
    """A card given out whole is watched too: a GPU process of no registered container
    there is unallocated and killed."""
    _, allocator, _ = parts
    allocator.allocate(ResourceKind.WHOLE, [GPU1])
    usage = Usage()
    usage.processes = [ProcessUsage(stray.pid, GPU1, 8000)]
    [violation] = watchdog(parts, usage).scan()
    assert violation.kind == "unallocated" and "a card given out whole" in violation.detail
    assert gone(stray)


def test_unreadable_usage_fails_closed_and_says_why_until_a_scan_judges(parts, caplog):
    """Per-process GPU memory that cannot be read is no silent pause: each such scan is
    counted, the watchdog has a problem naming why (the daemon is unhealthy then), the
    log says it once; the first scan that judges clears it and says so."""
    usage = Usage()
    usage.error = "NVML: GPU is lost"
    dog = watchdog(parts, usage)
    with caplog.at_level(logging.INFO):
        assert dog.scan() == [] and dog.scan() == []
        summary = dog.summary()
        why = "cannot read per-process GPU memory: NVML: GPU is lost"
        assert dog.problem == f"enforcement cannot judge: {why}"
        assert (summary["judging"], summary["problem"], summary["failed_scans"]) == (
            False,
            dog.problem,
            2,
        )
        assert dog.health()["problem"] == dog.problem and dog.last_usage is None
        usage.error = None
        dog.scan()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("enforcement cannot judge" in m and "unhealthy" in m for m in messages) == 1
    assert any("judges the GPU processes again" in m for m in messages)
    assert dog.problem is None and dog.summary()["judging"] is True


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


# --- one hostile process never stops enforcement (issue 14, item 3) ------------------------


def test_a_gpu_process_in_a_cgroup_named_0xff_is_unallocated_and_the_scan_goes_on(parts, stray):
    """A process whose /proc/PID/cgroup is not UTF-8 cannot be tied to any container: it
    is judged unallocated (fail closed) and killed; the other processes of the same scan
    are still judged; the unreadable one is counted and logged once."""
    from tests.unit.enforcement.test_procfs import process_in_cgroup_named

    with process_in_cgroup_named(b"gs-\xff") as hostile:
        usage = Usage()
        usage.processes = [ProcessUsage(hostile.pid, GPU0, 300), ProcessUsage(stray.pid, GPU0, 1)]
        dog = watchdog(parts, usage)
        violations = dog.scan()
        assert sorted(v.pids for v in violations) == sorted([(hostile.pid,), (stray.pid,)])
        assert {v.kind for v in violations} == {"unallocated"}
        [detail] = [v.detail for v in violations if v.pids == (hostile.pid,)]
        assert "cgroup" in detail and "UTF-8" in detail
        assert gone(hostile) and gone(stray)
        assert dog.summary()["unreadable_processes"] == 1


def test_an_exec_in_a_cgroup_named_0xff_does_not_kill_the_watchdog_thread(parts, stray):
    """The process events name each exec; one in a cgroup named with 0xff used to raise
    outside any handler and end the watchdog's thread for good."""
    from nodemgr.enforcement.procevents import Events
    from tests.unit.enforcement.test_procfs import process_in_cgroup_named

    with process_in_cgroup_named(b"gs-\xff") as hostile:

        class Execs:
            def read(self, timeout_seconds):
                time.sleep(min(timeout_seconds, 0.05))
                return Events(execs=[hostile.pid])

            def wake(self):
                pass

            def close(self):
                pass

        usage = Usage()
        usage.processes = [ProcessUsage(stray.pid, GPU0, 300)]
        dog = watchdog(parts, usage, events_source=Execs)
        dog.start()
        try:
            assert gone(stray, 3)  # enforcement goes on
            time.sleep(0.3)
            assert dog.alive, f"the watchdog died: {dog.failure!r}"
            assert dog.failure is None
        finally:
            dog.stop()
            assert dog.join(2)


class Fatal(BaseException):
    """Not an Exception: escapes ``except Exception`` (as MemoryError-like surprises do)."""


def test_a_watchdog_whose_scan_raises_past_its_handler_is_restarted(parts, stray, caplog):
    """A scan that raises what the loop does not catch ends run(); the worker is started
    again (with backoff) and goes on enforcing: the stray is killed after the restart."""
    import contextlib

    from nodemgr.common.workers import Workers

    usage = Usage()
    usage.processes = [ProcessUsage(stray.pid, GPU0, 300)]
    dog = watchdog(parts, usage, events_source=None)
    real_scan, calls = dog.scan, []

    def scan():
        calls.append(1)
        if len(calls) == 1:
            raise Fatal("scan blew up")
        return real_scan()

    dog.scan = scan
    with caplog.at_level(logging.WARNING), contextlib.ExitStack() as stack:
        group = Workers(stack, restart_backoff_seconds=(0.05, 0.05))
        group.start(dog)
        group.stop_all_first()
        assert gone(stray, 3), "not enforcing after the failure"
        assert dog.alive and dog.restarts == 1 and isinstance(dog.failure, Fatal)
        assert group.dead() == []
    assert any(
        "watchdog died" in r.getMessage() and "restarting" in r.getMessage() for r in caplog.records
    )


def test_an_unreadable_environ_in_a_container_is_an_env_violation_counted_once(
    parts, monkeypatch, caplog
):
    """Fail closed on environ too: a registered container's GPU process whose environ
    cannot be read (over 1 MiB, say) has no quota env to trust: an env violation. It is
    counted and logged once, not once per scan."""
    from nodemgr.domain.model import CgroupKey, Registration
    from nodemgr.enforcement import procfs

    ledger, allocator, registry = parts
    allocator.allocate(ResourceKind.MEMORY, [f"{GPU0}-_-0"])
    [allocation] = allocator.allocations()
    process = subprocess.Popen(["sleep", "1000"])
    try:
        registration = Registration("c1", allocation.id, CgroupKey("", "/pod/c1"), 1, 0, None, 0.0)
        monkeypatch.setattr(registry, "registrations", lambda: [registration])
        monkeypatch.setattr(registry, "prune", lambda: None)
        monkeypatch.setattr(procfs, "read_cgroups_text", lambda pid: "0::/pod/c1\n")

        def too_large(pid):
            raise procfs.ProcfsError(f"/proc/{pid}/environ is larger than 1048576 bytes")

        monkeypatch.setattr(procfs, "read_gpu_env", too_large)
        usage = Usage()
        usage.processes = [ProcessUsage(process.pid, GPU0, 100)]
        dog = watchdog(parts, usage, action="log")
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                [violation] = dog.scan()
                assert violation.kind == "env" and "larger than 1048576" in violation.detail
        assert dog.summary()["unreadable_processes"] == 1
        assert (
            sum(
                "larger than 1048576" in r.getMessage()
                and "judged as without quota env" in r.getMessage()
                for r in caplog.records
            )
            == 1
        )
    finally:
        process.kill()
        process.wait()


def test_one_failing_violation_report_does_not_spare_the_others(parts, monkeypatch):
    """Acting on each violation is on its own: a report that raises (a bug, a ledger
    surprise) still leaves that offender and the others killed."""
    first = subprocess.Popen(["sleep", "1000"])
    second = subprocess.Popen(["sleep", "1000"])
    try:
        usage = Usage()
        usage.processes = [ProcessUsage(first.pid, GPU0, 10), ProcessUsage(second.pid, GPU0, 10)]
        dog = watchdog(parts, usage)
        reported = []

        def report(violation):
            reported.append(violation)
            if len(reported) == 1:
                raise RuntimeError("a bug")

        monkeypatch.setattr(dog, "_report", report)
        assert len(dog.scan()) == 2
        assert len(reported) == 2 and gone(first) and gone(second)
    finally:
        for p in (first, second):
            p.kill()
            p.wait()


def test_an_exec_flood_brings_one_scan_forward_without_reading_each_process():
    """Hundreds of execs in one batch (a fork-and-exec storm in any pod) are not read one
    /proc/PID/cgroup at a time: the batch just brings the next scan forward."""
    from types import SimpleNamespace

    from nodemgr.enforcement import watchdog as module

    reads = []
    dog = module.Watchdog.__new__(module.Watchdog)
    dog._cache = {}
    dog._registry = SimpleNamespace(registrations=lambda: [])
    dog._in_registered_container = lambda pid, index: reads.append(pid) or False
    flood = SimpleNamespace(execs=set(range(1000, 1000 + 500)), exits=set(), lost=False)
    assert dog._news_wants_a_scan(flood) is True
    assert reads == []


class NarrowState:
    """Only what the watchdog may ask of the allocation state: the cards, the live
    allocations by ID, the cards given out whole, a card's label."""

    def __init__(self, cards):
        self.cards = cards

    def allocations_by_id(self):
        return {}

    def whole_cards(self):
        return set()

    def card_label(self, card_uuid):
        return f"GPU? ({card_uuid})"


def test_the_watchdog_asks_the_allocation_state_only_through_its_narrow_view(
    parts, settings, stray
):
    """Over an object with the watchdog's view of the allocation state alone (no Allocator),
    a stray GPU process on a shared card is found and killed."""
    ledger, _, registry = parts
    usage = Usage()
    usage.processes = [ProcessUsage(stray.pid, GPU0, 300)]
    state = NarrowState(open_inventory(settings.gpus).cards())
    dog = Watchdog(EnforcementSettings(action="kill"), registry, state, usage, ledger)
    [violation] = dog.scan()
    assert violation.kind == "unallocated" and violation.pids == (stray.pid,)
    assert gone(stray)


# --- out of descriptors: fail closed, never a silent pause ---------------------------------------


def test_a_scan_without_a_descriptor_left_judges_nobody_and_says_so(parts, stray, caplog):
    """With no descriptor left the scan cannot read /proc: it judges nobody (the stray is not
    taken for a process of no container, nor skipped in silence), the watchdog has a problem
    naming EMFILE (the daemon is unhealthy then) and the scan is counted as failed; with
    descriptors back, the next scan kills the stray and clears the problem."""
    usage = Usage()
    usage.processes = [ProcessUsage(stray.pid, GPU0, 300)]
    dog = watchdog(parts, usage)
    with caplog.at_level(logging.WARNING), no_descriptors_left():
        violations = dog.scan()
    assert violations == [] and stray.poll() is None
    assert dog.problem is not None and "cannot read /proc" in dog.problem, dog.problem
    assert "Too many open files" in dog.problem
    assert dog.summary()["failed_scans"] == 1 and dog.summary()["judging"] is False
    [violation] = dog.scan()
    assert violation.kind == "unallocated" and gone(stray)
    assert dog.problem is None and dog.summary()["judging"] is True


def test_a_kill_that_cannot_be_done_makes_the_watchdog_unhealthy(parts, stray, monkeypatch):
    """A violation whose kill fails for want of a descriptor is not a logged shrug: the
    watchdog has a problem (cannot kill) until a scan acts again."""
    usage = Usage()
    usage.processes = [ProcessUsage(stray.pid, GPU0, 300)]
    dog = watchdog(parts, usage)

    def exhausted(pid, start_ticks):
        raise procfs.Exhausted(f"cannot open a pidfd for process {pid}: Too many open files")

    monkeypatch.setattr(procfs, "kill", exhausted)
    [violation] = dog.scan()
    assert stray.poll() is None
    assert dog.problem is not None and dog.problem.startswith("enforcement cannot judge: ")
    assert "cannot kill (unallocated violation): cannot open a pidfd" in dog.problem
    monkeypatch.undo()
    dog.scan()
    assert gone(stray) and dog.problem is None


def test_a_usage_source_failing_unexpectedly_fails_the_scan_closed(parts):
    """Not only InventoryError: whatever the usage source raises (an OSError from below
    NVML's binding) is a scan that cannot judge, with the error named."""
    usage = Usage()

    def broken():
        raise OSError(24, "Too many open files")

    usage.process_usage = broken
    dog = watchdog(parts, usage)
    assert dog.scan() == []
    assert dog.problem == (
        "enforcement cannot judge: cannot read per-process GPU memory: "
        "OSError: [Errno 24] Too many open files"
    )


def test_a_scan_that_raises_is_a_problem_until_one_judges(parts, monkeypatch):
    """A scan that fails with a bug is logged and retried, and meanwhile the watchdog has a
    problem (no silent pause); the next scan that judges clears it."""
    from nodemgr.enforcement import watchdog as module

    usage = Usage()
    usage.processes = [ProcessUsage(os.getpid(), GPU0, 100)]
    dog = watchdog(parts, usage, action="log")
    dog._settings = EnforcementSettings(action="log", interval_seconds=0.05)

    def bug(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(module, "find_violations", bug)
    dog.start()
    try:
        deadline = time.monotonic() + 5
        while dog.problem is None:
            assert time.monotonic() < deadline, "no problem reported"
            time.sleep(0.01)
        assert dog.problem == "enforcement cannot judge: the scan failed (KeyError: 'a bug')"
        assert dog.alive
        monkeypatch.undo()
        while dog.problem is not None:
            assert time.monotonic() < deadline + 5, "the problem was never cleared"
            time.sleep(0.01)
    finally:
        dog.stop()
        dog.join(5)
