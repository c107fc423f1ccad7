"""Pins nodemgr.common.workers: a ThreadWorker whose ``run`` raises is logged at CRITICAL
naming the worker, keeps the exception in ``failure`` and stops being ``alive`` (the run
loop reports it); ``stop`` sets the stop event and wakes the worker; a second start is
refused; ``running`` registers each stop on the ExitStack at once, so stops run in LIFO
order, also when a later start fails; ``Workers.stop_all_first`` asks every worker to stop
before any is joined; ``stop_and_join`` says in the log when a worker does not end.
Started through ``Workers``, a ThreadWorker that dies (or whose run returns unasked) is
restarted with backoff, is down while it waits, and stays dead past its last backoff step;
``Workers.health`` says so per worker."""

import contextlib
import logging
import threading
import time

import pytest

from nodemgr.common import workers
from nodemgr.common.workers import ThreadWorker, Workers, running, stop_and_join


class Recording:
    """A worker that records its calls into a shared list; joins as told."""

    def __init__(self, name, events, joins=True, fail_start=False, fail_stop=False):
        self.name = name
        self.events = events
        self._joins = joins
        self._fail_start = fail_start
        self._fail_stop = fail_stop
        self.alive = False

    def start(self):
        if self._fail_start:
            raise OSError(f"{self.name} cannot bind")
        self.events.append(("start", self.name))
        self.alive = True

    def stop(self):
        self.events.append(("stop", self.name))
        self.alive = False
        if self._fail_stop:
            raise RuntimeError(f"{self.name} stop failed")

    def join(self, timeout_seconds):
        self.events.append(("join", self.name))
        return self._joins


class Looping(ThreadWorker):
    """Loops until stopped; says when it began."""

    def __init__(self, name="looper"):
        super().__init__(name)
        self.began = threading.Event()
        self.woken = threading.Event()

    def run(self, stop):
        self.began.set()
        stop.wait(30)

    def _wake(self):
        self.woken.set()


class Failing(ThreadWorker):
    def run(self, stop):
        raise ValueError("the ledger went away")


# --- ThreadWorker -----------------------------------------------------------------------


def test_a_failing_run_is_logged_kept_and_not_alive(caplog):
    """A run() that raises: CRITICAL log with the worker's name and the exception,
    ``failure`` holds it, ``alive`` is False."""
    worker = Failing("mps-supervisor")
    with caplog.at_level(logging.CRITICAL, logger=workers.__name__):
        worker.start()
        assert worker.join(5), "the failing thread did not end"
    assert isinstance(worker.failure, ValueError)
    assert str(worker.failure) == "the ledger went away"
    assert worker.alive is False
    [record] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    message = record.getMessage()
    assert message.startswith("mps-supervisor died after")
    assert "ValueError: the ledger went away" in message
    assert "no longer runs" in message
    assert record.exc_info is not None  # the traceback goes to the log


def test_a_running_worker_is_alive_until_stopped():
    """alive while run() loops; stop() sets its stop event and wakes it; then it ends."""
    worker = Looping()
    assert worker.alive is False  # not started
    worker.start()
    assert worker.began.wait(5)
    assert worker.alive and not worker.stopping
    worker.stop()
    assert worker.woken.is_set()
    assert worker.stopping and not worker.alive
    assert worker.join(5)
    assert worker.failure is None


def test_join_times_out_while_running():
    """join returns False while the thread still runs, True for a never-started worker."""
    assert Looping().join(0.0) is True
    worker = Looping()
    worker.start()
    assert worker.began.wait(5)
    assert worker.join(0.01) is False
    worker.stop()
    assert worker.join(5) is True


def test_a_second_start_is_refused():
    """One thread per worker: starting again raises, naming the worker."""
    worker = Looping("publisher")
    worker.start()
    try:
        with pytest.raises(RuntimeError, match="publisher was already started"):
            worker.start()
    finally:
        worker.stop()
        worker.join(5)


def test_the_thread_carries_the_worker_name():
    """The thread is named after the worker (what a stack dump shows)."""
    worker = Looping("kube-publisher")
    worker.start()
    assert worker.began.wait(5)
    try:
        assert "kube-publisher" in {t.name for t in threading.enumerate()}
    finally:
        worker.stop()
        worker.join(5)


# --- running / stop_and_join ------------------------------------------------------------


def test_running_registers_stops_in_lifo_order():
    """Workers started with ``running`` are stopped (then joined) in reverse start order."""
    events = []
    with contextlib.ExitStack() as stack:
        for name in ("a", "b", "c"):
            assert running(stack, Recording(name, events)).name == name
        assert events == [("start", "a"), ("start", "b"), ("start", "c")]
        events.clear()
    assert events == [
        ("stop", "c"),
        ("join", "c"),
        ("stop", "b"),
        ("join", "b"),
        ("stop", "a"),
        ("join", "a"),
    ]


def test_a_failed_start_stops_what_already_runs():
    """A start that raises leaves the workers started before it stopped, and only those."""
    events = []

    def start_three():
        with contextlib.ExitStack() as stack:
            running(stack, Recording("a", events))
            running(stack, Recording("b", events))
            running(stack, Recording("c", events, fail_start=True))

    with pytest.raises(OSError, match="c cannot bind"):
        start_three()
    assert [e for e in events if e[0] == "stop"] == [("stop", "b"), ("stop", "a")]


def test_stop_and_join_logs_a_worker_that_does_not_end(caplog):
    """A worker still running after the timeout: False, and a warning naming it."""
    with caplog.at_level(logging.WARNING, logger=workers.__name__):
        assert stop_and_join(Recording("hook-server", [], joins=False), 0.5) is False
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "hook-server did not stop within 0.5 s; leaving it behind"


def test_stop_and_join_is_quiet_when_the_worker_ends(caplog):
    """A worker that ends in time: True, nothing logged."""
    events = []
    with caplog.at_level(logging.DEBUG, logger=workers.__name__):
        assert stop_and_join(Recording("w", events), 0.5) is True
    assert events == [("stop", "w"), ("join", "w")]
    assert caplog.records == []


# --- Workers ----------------------------------------------------------------------------


def test_stop_all_first_asks_every_worker_before_any_join():
    """On exit, every worker is asked to stop before the first join: the joins overlap."""
    events = []
    with contextlib.ExitStack() as stack:
        group = Workers(stack)
        for name in ("a", "b", "c"):
            group.start(Recording(name, events))
        group.stop_all_first()
        events.clear()
    first_join = next(i for i, e in enumerate(events) if e[0] == "join")
    assert {e[1] for e in events[:first_join] if e[0] == "stop"} == {"a", "b", "c"}
    assert [e for e in events if e[0] == "join"] == [("join", "c"), ("join", "b"), ("join", "a")]


def test_one_failing_stop_request_does_not_spare_the_others(caplog):
    """A worker whose stop raises while all are asked: logged, the rest are still asked."""
    events = []

    def start_three_and_stop():
        with contextlib.ExitStack() as stack:
            group = Workers(stack)
            group.start(Recording("a", events))
            group.start(Recording("b", events, fail_stop=True))
            group.start(Recording("c", events))
            group.stop_all_first()
            events.clear()

    with caplog.at_level(logging.ERROR, logger=workers.__name__):
        with pytest.raises(RuntimeError):  # its own stop_and_join later raises again
            start_three_and_stop()
    assert events[:3] == [("stop", "c"), ("stop", "b"), ("stop", "a")]
    assert any("asking b to stop failed" in r.getMessage() for r in caplog.records)


def test_dead_names_the_workers_no_longer_alive():
    """``dead`` lists the started workers that died or stopped early, by name."""
    events = []
    with contextlib.ExitStack() as stack:
        group = Workers(stack)
        first, second = group.start(Recording("a", events)), group.start(Recording("b", events))
        assert group.dead() == []
        second.alive = False
        assert group.dead() == ["b"]
        assert first.alive


def test_problems_name_running_workers_that_cannot_do_their_job():
    """A running ThreadWorker with a ``problem`` is named with it by ``problems`` (up, not
    dead) and its health says it; cleared, it is no longer named."""
    with contextlib.ExitStack() as stack:
        group = Workers(stack)
        worker = group.start(Looping("watchdog"))
        group.start(Looping("supervisor"))
        group.stop_all_first()
        assert worker.began.wait(5)
        assert group.problems() == []
        worker.problem = "enforcement cannot judge: cannot read /proc: Too many open files"
        assert group.problems() == [f"watchdog: {worker.problem}"]
        assert group.dead() == []
        assert group.health()["watchdog"] == {
            "up": True,
            "restarts": 0,
            "failure": None,
            "problem": worker.problem,
        }
        worker.problem = None
        assert group.problems() == []


def test_a_worker_stuck_past_the_stop_budget_is_left_behind_and_said(caplog):
    """One budget for all stops: a worker that ignores its stop (stuck in a hung command)
    is left behind with a warning naming it, so the daemon still exits on time."""
    import contextlib
    import threading

    from nodemgr.common.workers import ThreadWorker, Workers

    release = threading.Event()

    class Stuck(ThreadWorker):
        def run(self, stop):
            release.wait(30)  # ignores stop, like a thread blocked in a subprocess

    class Prompt(ThreadWorker):
        def run(self, stop):
            stop.wait()

    prompt = Prompt("prompt")
    stuck = Stuck("stuck-worker")
    try:
        with caplog.at_level("WARNING"), contextlib.ExitStack() as stack:
            workers = Workers(stack, stop_budget_seconds=0.2)
            workers.start(stuck)
            workers.start(prompt)
            workers.stop_all_first()
        assert prompt.join(0)  # the prompt one ended within the budget
        assert stuck._thread.is_alive()  # left behind, not waited for
        assert any("stuck-worker did not stop" in r.getMessage() for r in caplog.records)
    finally:
        release.set()


# --- supervised restarts (issue 14, item 3) -----------------------------------------------------


class FlakyThenLooping(ThreadWorker):
    """Dies ``deaths`` times (a BaseException the loop's own handlers would miss), then loops."""

    def __init__(self, name, deaths, error=KeyboardInterrupt):
        super().__init__(name)
        self.deaths = deaths
        self.runs = 0
        self.error = error
        self.looping = threading.Event()

    def run(self, stop):
        self.runs += 1
        if self.runs <= self.deaths:
            raise self.error(f"death {self.runs}")
        self.looping.set()
        stop.wait(30)


def test_a_worker_that_dies_is_restarted_with_backoff_and_logged(caplog):
    """Started through Workers, a ThreadWorker whose run() raises is run again after each
    backoff step; it is alive again and counts its restarts; each death is CRITICAL."""
    with caplog.at_level(logging.WARNING, logger=workers.__name__), contextlib.ExitStack() as s:
        group = Workers(s, restart_backoff_seconds=(0.01, 0.02, 0.04))
        worker = group.start(FlakyThenLooping("watchdog", deaths=2))
        group.stop_all_first()
        assert worker.looping.wait(5)
        assert worker.alive and worker.restarts == 2 and worker.runs == 3
        assert isinstance(worker.failure, KeyboardInterrupt)  # the last death is kept
        assert group.dead() == []
        assert group.health()["watchdog"] == {
            "up": True,
            "restarts": 2,
            "failure": "KeyboardInterrupt: death 2",
            "problem": None,
        }
    deaths = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(deaths) == 2 and all("restarting it in" in m for m in deaths)


def test_a_worker_dead_beyond_its_restarts_stays_dead_and_is_named():
    """After the last backoff step a worker that still dies is left dead: not alive,
    named by ``dead`` and ``health``, and no further run is attempted."""
    with contextlib.ExitStack() as stack:
        group = Workers(stack, restart_backoff_seconds=(0.01, 0.01))
        worker = group.start(FlakyThenLooping("publisher", deaths=99, error=ValueError))
        group.stop_all_first()
        assert worker.join(5), "still restarting after its last backoff step"
        assert worker.runs == 3 and worker.restarts == 2
        assert not worker.alive and group.dead() == ["publisher"]
        assert group.health()["publisher"] == {
            "up": False,
            "restarts": 2,
            "failure": "ValueError: death 3",
            "problem": None,
        }


def test_a_run_that_returns_before_its_stop_counts_as_a_death():
    """run() must loop until stopped: returning early is a death too (and restarted)."""

    class Quitter(ThreadWorker):
        runs = 0

        def run(self, stop):
            self.runs += 1
            if self.runs > 1:
                stop.wait(30)

    with contextlib.ExitStack() as stack:
        group = Workers(stack, restart_backoff_seconds=(0.01,))
        worker = group.start(Quitter("quitter"))
        group.stop_all_first()
        deadline = time.monotonic() + 5
        while worker.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.restarts == 1 and worker.alive
        assert "returned" in group.health()["quitter"]["failure"]


def test_a_stop_during_the_backoff_ends_the_worker_at_once():
    with contextlib.ExitStack() as stack:
        group = Workers(stack, restart_backoff_seconds=(30.0,))
        worker = group.start(FlakyThenLooping("w", deaths=1))
        deadline = time.monotonic() + 5
        while worker.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not worker.alive  # down while waiting to be restarted
        worker.stop()
        assert worker.join(2)
        assert worker.runs == 1
