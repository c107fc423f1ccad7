"""Pins nodemgr.runtime.loop.RunLoop with a real notify socket (standins/notify_listener.py)
and ServiceNotifier, a real Allocator and stand-ins for the rest: a healthy iteration says
READY=1 once and then only STATUS when it changed; a card problem holds READY back and
shows in STATUS; no WATCHDOG=1 while the allocation state is unresponsive; a SIGHUP reload
applies the reloadable keys to the parts that use them, names what needs a restart, and
refuses a bad file keeping the running settings; a reconcile never runs on a failed read
of kubelet's record; waiting for kubelet is reported and keeps the watchdog fed; while a
background worker is dead there is no WATCHDOG=1 (not even while waiting for kubelet) and
STATUS names it.

Why this module is longer than 400 lines: it pins everything the run loop tells systemd
(READY, STATUS, WATCHDOG, RELOADING) in each state the daemon can be in, with a real
notify socket.
"""

import os
import shutil
import tempfile
import threading
import time

import pytest

from nodemgr.allocation.allocator import Allocator
from nodemgr.allocation.ledger import Ledger
from nodemgr.config.loading import load_settings
from nodemgr.domain.deviceids import ResourceKind
from nodemgr.errors import LedgerError
from nodemgr.inventory import open_inventory
from nodemgr.kubelet.registration import KubeletUnavailable
from nodemgr.runtime.loop import RunLoop
from nodemgr.runtime.notify import ServiceNotifier
from nodemgr.status.server import DaemonFacts
from standins.cards import GPU0, GPU1
from standins.kubelet_sim import TestKubelet
from standins.notify_listener import Listener

MEM, CORE = ResourceKind.MEMORY, ResourceKind.CORE
MARKER = "--- marker ---"


class Recorder:
    """Stands in for the watchdog, the MPS supervisor and the metrics: records calls."""

    def __init__(self):
        self.calls = []

    def set_settings(self, settings):
        self.calls.append(("set_settings", settings))

    def count_reconcile(self, result):
        self.calls.append(("count_reconcile", result))

    def count_reconcile_plan(self, plan):
        self.calls.append(("count_reconcile_plan", plan))

    def observe_allocate(self, *args):
        pass


class PodResources:
    """kubelet's record, or the error reading it raises."""

    def __init__(self, record=None, error=None):
        self.record = record or {}
        self.error = error

    def list(self):
        if self.error is not None:
            raise self.error
        return self.record


CONFIG = """\
node_name: node-a
state_dir: {root}/state
run_dir: {root}/run
kubelet:
  device_plugin_dir: {root}/dp
  pod_resources_socket: {root}/pr/kubelet.sock
  allocation_grace_seconds: 60
gpus:
  backend: simulated
  simulated:
    devices:
      - {{uuid: {gpu0}, name: Tesla T4, memory_mib: 15360}}
      - {{uuid: {gpu1}, name: Tesla T4, memory_mib: 15360}}
enforcement:
  action: {action}
{extra}
"""


class Daemon:
    """A RunLoop on a simulated two-card node, its systemd on a Listener."""

    def __init__(self, root, watchdog_usec="1000"):
        self.root = root
        self.config_path = os.path.join(root, "gpushare.yaml")
        self.write_config()
        self.settings = load_settings(self.config_path)
        self.ledger = Ledger(self.settings.state_dir)
        cards = open_inventory(self.settings.gpus).cards()
        self.allocator = Allocator(self.settings, cards, self.ledger)
        self.systemd = Listener()
        self.notifier = ServiceNotifier(
            {"NOTIFY_SOCKET": self.systemd.address, "WATCHDOG_USEC": watchdog_usec}
        )
        self.watchdog, self.supervisor, self.metrics = Recorder(), Recorder(), Recorder()
        self.podresources = PodResources()
        self.loop = RunLoop(
            self.settings,
            self.config_path,
            self.notifier,
            DaemonFacts(version="test"),
            self.allocator,
            self.supervisor,
            self.watchdog,
            self.podresources,
            self.metrics,
        )

    def write_config(self, extra="", action="kill"):
        with open(self.config_path, "w") as f:
            f.write(CONFIG.format(root=self.root, gpu0=GPU0, gpu1=GPU1, action=action, extra=extra))

    def next_message(self) -> dict[str, str]:
        """The next datagram systemd got (waits for it; fails after 5 s)."""
        self.systemd.sock.settimeout(5)
        data = self.systemd.sock.recv(4096)
        return dict(line.split("=", 1) for line in data.decode().split("\n"))

    def told(self) -> list[dict[str, str]]:
        """Everything sent to systemd so far: a marker is sent and read back (datagrams on
        one socket arrive in order), so nothing is waited for but the marker itself."""
        self.notifier.status(MARKER)
        messages = []
        while True:
            message = self.next_message()
            if message == {"STATUS": MARKER}:
                return messages
            messages.append(message)

    def close(self):
        self.systemd.close()
        self.ledger.close()


@pytest.fixture
def make_daemon():
    made = []

    def make(watchdog_usec="1000"):
        root = tempfile.mkdtemp(dir="/tmp", prefix="gs-loop-")
        made.append(Daemon(root, watchdog_usec))
        return made[-1]

    yield make
    for daemon in made:
        daemon.close()
        shutil.rmtree(daemon.root, ignore_errors=True)


@pytest.fixture
def daemon(make_daemon):
    return make_daemon()


def allocate(allocator, size=4):
    ids = allocator.preferred(MEM, [d.id for d in allocator.devices(MEM)], [], size)
    allocator.allocate(MEM, ids)


# --- READY, STATUS, WATCHDOG --------------------------------------------------------------


def test_ready_once_then_status_only_when_it_changed(daemon):
    """The first healthy iteration sends READY=1 with the summary; later ones send no
    READY, and STATUS only when the summary changed; each pings the watchdog."""
    daemon.loop._tell_systemd(3)
    daemon.loop._tell_systemd(3)
    first = daemon.told()
    assert first[0] == {"READY": "1", "STATUS": "serving 3 resources on 2 GPUs, 0 allocations"}
    assert daemon.loop.facts.ready is True
    assert all("READY" not in m and "STATUS" not in m for m in first[1:])
    assert {"WATCHDOG": "1"} in first[1:]

    allocate(daemon.allocator)
    daemon.loop._tell_systemd(3)
    later = daemon.told()
    assert {"STATUS": "serving 3 resources on 2 GPUs, 1 allocation"} in later
    assert not [m for m in later if "READY" in m]


def test_a_card_problem_holds_ready_back_and_shows(daemon):
    """While a card has a problem (MPS down) the daemon is not READY; STATUS says what
    waits and names the card; once it is fixed, READY=1 follows."""
    daemon.allocator.set_card_problem(GPU1, "MPS server not running")
    daemon.loop._tell_systemd(3)
    waiting = daemon.told()
    assert not [m for m in waiting if "READY" in m]
    assert {
        "STATUS": "waiting for MPS: serving 3 resources on 2 GPUs, 0 allocations; "
        f"GPU1 ({GPU1}): MPS server not running"
    } in waiting
    assert daemon.loop.facts.ready is False

    daemon.allocator.set_card_problem(GPU1, None)
    daemon.loop._tell_systemd(3)
    assert daemon.told()[0]["READY"] == "1"


def test_no_watchdog_ping_while_the_allocation_state_is_unresponsive(daemon, monkeypatch):
    """A stuck allocator cannot answer Allocate: no WATCHDOG=1, so systemd restarts us;
    READY and STATUS still go out."""
    monkeypatch.setattr(daemon.allocator, "responsive", lambda timeout_seconds: False)
    daemon.loop._tell_systemd(3)
    daemon.loop._tell_systemd(3)
    told = daemon.told()
    assert told[0]["READY"] == "1"
    assert not [m for m in told if "WATCHDOG" in m]
    monkeypatch.undo()
    daemon.loop._tell_systemd(3)
    assert {"WATCHDOG": "1"} in daemon.told()


def test_period_keeps_pace_with_the_watchdog(daemon):
    """The loop turns at least four times per watchdog interval, at most every 0.5 s."""
    assert daemon.loop._period() == pytest.approx(0.001 / 4)
    daemon.loop.notifier = ServiceNotifier({})
    assert daemon.loop._period() == 0.5


# --- reload -------------------------------------------------------------------------------


def test_reload_applies_reloadable_keys_to_the_running_parts(daemon):
    """A reload wraps RELOADING=1 / READY=1, hands the new enforcement settings to the
    watchdog, the grace period to the allocator and the MPS settings to the supervisor,
    and says what it applied."""
    daemon.write_config("mps:\n  health_check_interval_seconds: 9\n", action="log")
    daemon.loop._reload()
    told = daemon.told()
    assert told[0]["RELOADING"] == "1"
    assert told[1] == {
        "READY": "1",
        "STATUS": f"reloaded {daemon.config_path}: applied mps.health_check_interval_seconds, "
        "enforcement.action",
    }
    settings = daemon.loop.settings
    assert settings.enforcement.action == "log"
    assert settings.mps.health_check_interval_seconds == 9
    assert daemon.watchdog.calls == [("set_settings", settings.enforcement)]
    assert daemon.supervisor.calls == [("set_settings", settings.mps)]


def test_reload_names_what_needs_a_restart_and_keeps_it(daemon):
    """A key that cannot change while running keeps its value and is named in STATUS; the
    reloadable grace period reaches the allocator (its next reconcile uses it)."""
    allocate(daemon.allocator)
    daemon.loop._reconcile()
    assert len(daemon.allocator.allocations()) == 1  # within the 60 s grace: kept
    with open(daemon.config_path) as f:
        text = f.read().replace("allocation_grace_seconds: 60", "allocation_grace_seconds: 0")
    with open(daemon.config_path, "w") as f:
        f.write(text + "resources:\n  placement: spread\n")
    daemon.loop._reload()
    status = daemon.told()[1]["STATUS"]
    assert status == (
        f"reloaded {daemon.config_path}: applied kubelet.allocation_grace_seconds; "
        "needs a restart to take effect: resources.placement"
    )
    assert daemon.loop.settings.resources.placement == "binpack"
    assert daemon.loop.settings.kubelet.allocation_grace_seconds == 0
    daemon.loop._reconcile()
    assert daemon.allocator.allocations() == []  # no grace any more: released


def test_a_bad_file_is_refused_and_the_settings_stay(daemon):
    """An invalid file: READY=1 with 'reload refused' naming the key, the running
    settings untouched, nothing handed to the parts."""
    before = daemon.loop.settings
    with open(daemon.config_path, "a") as f:
        f.write("resources:\n  placement: everywhere\n")
    daemon.loop._reload()
    told = daemon.told()
    assert told[0]["RELOADING"] == "1"
    assert told[1]["READY"] == "1"
    assert told[1]["STATUS"].startswith("reload refused: ")
    assert "resources.placement" in told[1]["STATUS"]
    assert daemon.loop.settings is before
    assert daemon.watchdog.calls == [] and daemon.supervisor.calls == []


# --- reconcile ----------------------------------------------------------------------------


def test_a_failed_read_of_kubelets_record_releases_nothing(daemon):
    """kubelet unavailable: the reconcile is skipped (counted), every allocation kept."""
    allocate(daemon.allocator)
    daemon.allocator.set_grace_seconds(0)
    daemon.podresources.error = KubeletUnavailable("kubelet restarting")
    daemon.loop._reconcile()
    assert len(daemon.allocator.allocations()) == 1
    assert daemon.metrics.calls == [("count_reconcile", "skipped")]


def test_a_reconcile_that_fails_is_counted_as_failed(daemon, monkeypatch):
    """An error inside reconcile (the ledger) is counted as failed, not raised."""

    def broken(record):
        raise LedgerError("cannot write the ledger")

    monkeypatch.setattr(daemon.allocator, "reconcile", broken)
    daemon.loop._reconcile()
    assert daemon.metrics.calls == [("count_reconcile", "failed")]


def test_a_reconcile_releases_what_kubelet_no_longer_holds(daemon):
    """kubelet's record without the allocation, grace over: released, counted ok."""
    allocate(daemon.allocator)
    daemon.allocator.set_grace_seconds(0)
    daemon.loop._reconcile()
    assert daemon.allocator.allocations() == []
    assert daemon.metrics.calls[0] == ("count_reconcile", "ok")
    assert len(daemon.metrics.calls[1][1].delete) == 1


# --- waiting for kubelet ------------------------------------------------------------------


def test_waiting_for_kubelet_is_reported_and_stop_ends_the_loop(make_daemon):
    """No kubelet.sock yet: STATUS says so and the watchdog keeps being pinged (waiting is
    healthy); a stop ends run() and our sockets are removed."""
    daemon = make_daemon(watchdog_usec="400000")
    stop = threading.Event()
    runner = threading.Thread(target=daemon.loop.run, args=(stop, threading.Event()))
    runner.start()
    try:
        seen = [daemon.next_message()]
        while seen.count({"WATCHDOG": "1"}) < 2:  # pinged again and again while waiting
            seen.append(daemon.next_message())
    finally:
        stop.set()
        runner.join(10)
    assert not runner.is_alive()
    assert seen[0] == {
        "STATUS": f"waiting for kubelet: {daemon.root}/dp/kubelet.sock does not exist yet"
    }
    assert not [m for m in seen if "READY" in m]
    assert [n for n in os.listdir(f"{daemon.root}/dp") if n.endswith(".sock")] == []


# --- a reload's outcome in STATUS -----------------------------------------------------------


def test_a_reload_outcome_stays_in_status_until_the_summary_changes_or_time_passes(daemon):
    """The outcome of a reload (READY=1 with STATUS=) is not overwritten by the summary of
    the same or the next iterations: `systemctl status` must show a refusal (it did not:
    tests/systemd). The summary comes back once RELOAD_STATUS_SECONDS have passed, or at
    once when it changes."""
    from nodemgr.runtime.loop import RELOAD_STATUS_SECONDS
    from standins.clock import Clock

    clock = Clock()
    daemon.loop.clock = clock
    summary = "serving 3 resources on 2 GPUs, 0 allocations"
    daemon.loop._tell_systemd(3)
    assert daemon.told()[0] == {"READY": "1", "STATUS": summary}

    with open(daemon.config_path, "a") as f:
        f.write("resources:\n  placement: everywhere\n")
    daemon.loop._reload()
    daemon.loop._tell_systemd(3)  # the same iteration of the run loop
    clock.now += RELOAD_STATUS_SECONDS - 1
    daemon.loop._tell_systemd(3)
    statuses = [m["STATUS"] for m in daemon.told() if "STATUS" in m]
    assert statuses[0] == "reloading"
    # The key first: no "gpushare-node: config error:" (that is for stderr) in STATUS.
    assert statuses[1].startswith("reload refused: resources.placement: ")
    assert statuses[1:] == [statuses[1]]  # no summary over it

    clock.now += 2
    daemon.loop._tell_systemd(3)
    assert {"STATUS": summary} in daemon.told()

    daemon.write_config(action="log")
    daemon.loop._reload()
    daemon.loop._tell_systemd(3)
    applied = f"reloaded {daemon.config_path}: applied enforcement.action"
    assert [m["STATUS"] for m in daemon.told() if "STATUS" in m] == ["reloading", applied]
    allocate(daemon.allocator)  # the summary changes: it is news, shown at once
    daemon.loop._tell_systemd(3)
    assert {"STATUS": "serving 3 resources on 2 GPUs, 1 allocation"} in daemon.told()


# --- a dead worker makes the daemon unhealthy (issue 14, item 3) ----------------------------


def _dead_watchdog_workers(stack):
    """Real Workers holding a 'watchdog' ThreadWorker that died beyond its restarts."""
    from nodemgr.common.workers import ThreadWorker, Workers

    class Dies(ThreadWorker):
        def run(self, stop):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    group = Workers(stack, restart_backoff_seconds=())
    worker = group.start(Dies("watchdog"))
    group.stop_all_first()
    assert worker.join(5)
    return group


def test_no_watchdog_ping_while_a_worker_is_dead_and_status_names_it(daemon):
    """A worker dead beyond its restarts (the enforcement watchdog here): systemd gets no
    WATCHDOG=1 (so it restarts the daemon) and STATUS names the dead worker; once no worker
    is dead, the pings resume."""
    import contextlib

    with contextlib.ExitStack() as stack:
        group = _dead_watchdog_workers(stack)
        daemon.loop.dead_workers = group.dead
        daemon.loop._tell_systemd(3)
        daemon.loop._tell_systemd(3)
        told = daemon.told()
        assert not [m for m in told if "WATCHDOG" in m]
        statuses = [m["STATUS"] for m in told if "STATUS" in m]
        assert statuses and all("watchdog" in s and "not running" in s for s in statuses)
        assert not daemon.loop.facts.ready  # not READY=1 either: it is not healthy

    daemon.loop.dead_workers = list
    daemon.loop._tell_systemd(3)
    assert {"WATCHDOG": "1"} in daemon.told()


def test_no_watchdog_ping_while_a_worker_cannot_do_its_job_and_status_says_why(daemon):
    """A running worker with a problem (the enforcement watchdog unable to judge): no
    WATCHDOG=1, no READY=1, STATUS= says NOT HEALTHY with the worker and why; once the
    problem is gone, the pings resume."""
    why = "watchdog: enforcement cannot judge: cannot read /proc: Too many open files"
    problems = [why]
    daemon.loop.worker_problems = lambda: list(problems)
    daemon.loop._tell_systemd(3)
    told = daemon.told()
    assert not [m for m in told if "WATCHDOG" in m or "READY" in m]
    statuses = [m["STATUS"] for m in told if "STATUS" in m]
    assert statuses and statuses[-1].startswith(f"NOT HEALTHY: {why}; serving 3 resources")
    assert not daemon.loop.facts.ready
    problems.clear()
    daemon.loop._tell_systemd(3)
    told = daemon.told()
    assert {"WATCHDOG": "1"} in told and any("READY" in m for m in told)


def test_no_watchdog_ping_while_waiting_for_kubelet_with_a_dead_worker(make_daemon):
    """Waiting for kubelet pings systemd too: not while a worker is dead."""
    import contextlib

    daemon = make_daemon(watchdog_usec="400000")
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        daemon.loop.dead_workers = _dead_watchdog_workers(stack).dead
        runner = threading.Thread(target=daemon.loop.run, args=(stop, threading.Event()))
        runner.start()
        try:
            seen, deadline = [], time.monotonic() + 0.6  # a few periods of 0.1 s
            while time.monotonic() < deadline:
                seen.extend(daemon.systemd.messages(wait=0.05))
        finally:
            stop.set()
            runner.join(10)
    assert seen and not [m for m in seen if "WATCHDOG" in m]
    assert any("watchdog" in m.get("STATUS", "") for m in seen)


def test_ready_is_sent_as_soon_as_every_resource_is_registered(make_daemon, monkeypatch):
    """READY=1 follows the last registration at once, not one run loop period later (the
    start used to wait a whole period first; here the period is 15 s and READY must come
    within the 5 s of next_message)."""
    monkeypatch.setattr("nodemgr.runtime.loop.WATCH_PERIOD_SECONDS", 30.0)
    daemon = make_daemon(watchdog_usec="60000000")  # period: min(30, 60 / 4) = 15 s
    kubelet = TestKubelet(f"{daemon.root}/dp", f"{daemon.root}/pr/kubelet.sock")
    kubelet.start()
    stop = threading.Event()
    runner = threading.Thread(target=daemon.loop.run, args=(stop, threading.Event()))
    runner.start()
    try:
        seen = [daemon.next_message()]
        while "READY" not in seen[-1]:
            seen.append(daemon.next_message())
    finally:
        stop.set()
        runner.join(30)
        kubelet.stop()
    assert seen[-1]["READY"] == "1" and "serving 3 resources" in seen[-1]["STATUS"]


def test_ready_is_cleared_when_kubelet_goes_away(make_daemon):
    """``ready`` says what is true now, not what was once: when kubelet goes away (its
    socket removed) the daemon is neither registered nor ready until it registers again,
    and ready once more after that."""
    daemon = make_daemon(watchdog_usec="400000")  # period 0.1 s
    kubelet = TestKubelet(f"{daemon.root}/dp", f"{daemon.root}/pr/kubelet.sock")
    kubelet.start()
    stop = threading.Event()
    runner = threading.Thread(target=daemon.loop.run, args=(stop, threading.Event()))
    runner.start()
    facts = daemon.loop.facts

    def wait_for(condition):
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)
        return condition()

    try:
        assert wait_for(lambda: facts.ready and facts.registered)
        kubelet.stop()
        assert wait_for(lambda: not facts.registered)
        assert not facts.ready
        kubelet = TestKubelet(f"{daemon.root}/dp", f"{daemon.root}/pr/kubelet.sock")
        kubelet.start()
        assert wait_for(lambda: facts.ready and facts.registered)
    finally:
        stop.set()
        runner.join(30)
        kubelet.stop()


def test_ready_is_cleared_while_a_card_has_a_problem(daemon):
    """A card whose MPS goes down after READY makes the daemon not ready (status and
    doctor say so) without a second READY=1; fixed, it is ready again."""
    daemon.loop._tell_systemd(3)
    assert daemon.loop.facts.ready is True
    daemon.allocator.set_card_problem(GPU1, "MPS control daemon not answering")
    daemon.loop._tell_systemd(3)
    assert daemon.loop.facts.ready is False
    daemon.allocator.set_card_problem(GPU1, None)
    daemon.loop._tell_systemd(3)
    assert daemon.loop.facts.ready is True
    assert [m for m in daemon.told() if "READY" in m] == [
        {"READY": "1", "STATUS": "serving 3 resources on 2 GPUs, 0 allocations"}
    ]
