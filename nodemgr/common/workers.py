"""One lifecycle for every background part of the daemon: start, stop, join, alive.

A *worker* is anything the daemon starts and must stop: a thread with a
loop, a gRPC server, a unix socket server, the metrics HTTP server. Each
offers the same four calls (``Worker``), so the daemon wires them in one way:
:func:`running` starts a worker and at once registers its stop on a
``contextlib.ExitStack`` (every start is followed by its stop, in reverse
order, also when a later start fails).

``ThreadWorker`` is the base of the looping workers. Its thread must never
die silently: an exception that escapes the loop is logged at CRITICAL with
its traceback and kept in ``failure``, and ``alive`` turns False. Started
through :class:`Workers`, it is then run again after a backoff
(``RESTART_BACKOFF_SECONDS``, one step per consecutive death; a run that
lasted ``RESTART_RESET_SECONDS`` starts the steps over). Past the last step
it stays dead: ``Workers.dead`` names it, the run loop stops pinging
systemd's watchdog (so systemd restarts the whole daemon) and the status
document and metrics say which worker is down (``Workers.health``).

A ThreadWorker that runs but cannot do its job (the enforcement watchdog unable to
judge the node's GPU processes) says so in ``problem``: it is then up but not healthy,
``Workers.problems`` names it with the reason, and the run loop treats it as it treats
a dead worker (no watchdog ping to systemd; STATUS= says why) until the worker clears it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol, TypedDict, TypeVar

log = logging.getLogger(__name__)

JOIN_TIMEOUT_SECONDS = 2.0  # how long a stop waits for a worker before moving on
# How long all of a daemon's workers together may take to stop once asked: the
# daemon must exit within a second of SIGTERM (systemd, kubelet upgrades).
STOP_BUDGET_SECONDS = 0.6
# The waits before each restart of a worker that died, one per consecutive death; the
# last one spent, a worker that dies again stays dead. Together well under systemd's
# WatchdogSec (60 s): a worker that comes back in time does not restart the daemon.
RESTART_BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0)
# A run that lasted this long was healthy: its death starts the backoff over.
RESTART_RESET_SECONDS = 60.0


class WorkerHealth(TypedDict):
    """One worker as the status document and the metrics show it."""

    up: bool  # alive: started, not stopped, not dead or waiting to be restarted
    restarts: int  # times it was run again after dying, since the daemon started
    failure: str | None  # "<ExceptionType>: <message>" of its last death; None if none
    problem: str | None  # why it cannot do its job while up; None when it can


class Worker(Protocol):
    name: str

    def start(self) -> None:
        """Begin work; returns once the worker serves (sockets bound, thread started)."""
        ...

    def stop(self) -> None:
        """Ask the worker to stop; returns at once (servers may finish it here)."""
        ...

    def join(self, timeout_seconds: float) -> bool:
        """Wait up to ``timeout_seconds`` for the worker to end; True once it has."""
        ...

    @property
    def alive(self) -> bool:
        """Started, not stopped, and not failed."""
        ...


W = TypeVar("W", bound=Worker)


def running(
    stack: contextlib.ExitStack, worker: W, join_timeout_seconds: float = JOIN_TIMEOUT_SECONDS
) -> W:
    """Start ``worker`` and register its stop (then join) on ``stack``; returns the worker."""
    worker.start()
    stack.callback(stop_and_join, worker, join_timeout_seconds)
    return worker


def stop_and_join(worker: Worker, timeout_seconds: float = JOIN_TIMEOUT_SECONDS) -> bool:
    """Stop one worker and wait for it; says so in the log when it does not end in time."""
    worker.stop()
    if worker.join(timeout_seconds):
        return True
    log.warning("%s did not stop within %g s; leaving it behind", worker.name, timeout_seconds)
    return False


class ThreadWorker:
    """A worker whose body, ``run(stop)``, loops in one daemon thread until ``stop`` is set.

    Subclasses that block on something other than ``stop`` (a change counter,
    a socket) override ``_wake`` so that ``stop()`` interrupts that wait.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._stop_requested = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what ended run() last
        # Why the worker, running, cannot do its job now (it sets and clears it itself).
        self.problem: str | None = None
        self.restarts = 0  # times run() was started again after it died
        self._down = False  # dead, or waiting out a backoff before its restart
        self._restart_backoff: tuple[float, ...] = ()  # none unless supervised

    def supervise(self, backoff_seconds: Sequence[float]) -> None:
        """Run again after each death, waiting ``backoff_seconds[n]`` after the n-th in a
        row; call before ``start``. Without it a death is final (the default)."""
        self._restart_backoff = tuple(backoff_seconds)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was already started")
        self._thread = threading.Thread(target=self._body, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop_requested.set()
        self._wake()

    def join(self, timeout_seconds: float) -> bool:
        if self._thread is None:
            return True
        self._thread.join(max(timeout_seconds, 0.0))
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._stop_requested.is_set()
            and not self._down
        )

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    def run(self, stop: threading.Event) -> None:
        raise NotImplementedError

    def _wake(self) -> None:
        """Interrupt whatever ``run`` blocks on besides ``stop`` (default: nothing)."""

    def health(self) -> WorkerHealth:
        failure = self.failure
        return {
            "up": self.alive,
            "restarts": self.restarts,
            "failure": None if failure is None else f"{type(failure).__name__}: {failure}",
            "problem": self.problem,
        }

    def _body(self) -> None:
        deaths = 0  # in a row
        while True:
            started = time.monotonic()
            try:
                self.run(self._stop_requested)
                if self._stop_requested.is_set():
                    return
                raise RuntimeError("run() returned without being asked to stop")
            except BaseException as e:  # noqa: BLE001 - a worker must never die unseen
                error = e
            self.failure = error
            self._down = True
            ran = time.monotonic() - started
            if ran >= RESTART_RESET_SECONDS:
                deaths = 0
            backoff = self._restart_backoff
            if self._stop_requested.is_set() or deaths >= len(backoff):
                log.critical(
                    "%s died after %.1f s: %s: %s; this part of the daemon no longer runs",
                    self.name,
                    ran,
                    type(error).__name__,
                    error,
                    exc_info=error,
                )
                return
            delay = backoff[deaths]
            deaths += 1
            log.critical(
                "%s died after %.1f s: %s: %s; restarting it in %g s (restart %d of %d)",
                self.name,
                ran,
                type(error).__name__,
                error,
                delay,
                deaths,
                len(backoff),
                exc_info=error,
            )
            if self._stop_requested.wait(delay):
                return
            self.restarts += 1
            self._down = False
            log.warning("%s restarted (restart %d)", self.name, self.restarts)


class Workers:
    """The workers a daemon started, on one ExitStack: each start followed at once by its stop.

    ``start`` registers the worker's stop-and-join; ``stop_all_first`` (call it
    once, after the last start) registers a callback that runs before those and
    asks every worker to stop at once, so the joins overlap instead of adding up,
    and all of them share one budget of ``stop_budget_seconds``: a worker stuck
    past it (e.g. in a command to a hung MPS daemon) is left behind, said in the
    log, and the daemon exits on time (its threads are daemon threads).
    """

    def __init__(
        self,
        stack: contextlib.ExitStack,
        stop_budget_seconds: float = STOP_BUDGET_SECONDS,
        restart_backoff_seconds: Sequence[float] = RESTART_BACKOFF_SECONDS,
    ) -> None:
        self._stack = stack
        self._started: list[Worker] = []
        self._stop_budget_seconds = stop_budget_seconds
        self._restart_backoff = tuple(restart_backoff_seconds)
        self._stop_deadline: float | None = None  # monotonic, once the stop was requested

    def start(self, worker: W) -> W:
        """Start ``worker`` and register its stop; a ThreadWorker is restarted when it dies
        (``restart_backoff_seconds``). Other workers (servers) are only reported when down."""
        if isinstance(worker, ThreadWorker):
            worker.supervise(self._restart_backoff)
        worker.start()
        self._stack.callback(self._stop_and_join, worker)
        self._started.append(worker)
        return worker

    def _stop_and_join(self, worker: Worker) -> None:
        if self._stop_deadline is None:  # a start failed before stop_all_first: plain stop
            stop_and_join(worker)
            return
        stop_and_join(worker, max(0.0, self._stop_deadline - time.monotonic()))

    def stop_all_first(self) -> None:
        self._stack.callback(self._request_stop_all)

    def dead(self) -> list[str]:
        """Names of started workers that are no longer alive (died, or stopped early)."""
        return [worker.name for worker in self._started if not worker.alive]

    def problems(self) -> list[str]:
        """``<name>: <problem>`` of each running worker that cannot do its job now."""
        return [
            f"{worker.name}: {worker.problem}"
            for worker in self._started
            if isinstance(worker, ThreadWorker) and worker.alive and worker.problem
        ]

    def health(self) -> dict[str, WorkerHealth]:
        """Each started worker by name: up, restarts, last failure, problem (the status
        document)."""
        health: dict[str, WorkerHealth] = {}
        for worker in self._started:
            if isinstance(worker, ThreadWorker):
                health[worker.name] = worker.health()
            else:
                health[worker.name] = {
                    "up": worker.alive,
                    "restarts": 0,
                    "failure": None,
                    "problem": None,
                }
        return health

    def _request_stop_all(self) -> None:
        self._stop_deadline = time.monotonic() + self._stop_budget_seconds
        for worker in reversed(self._started):
            try:
                worker.stop()
            except Exception:  # the rest must still be asked; their own stop runs later too
                log.exception("asking %s to stop failed", worker.name)
