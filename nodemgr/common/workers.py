"""One lifecycle for every background part of the daemon: start, stop, join, alive.

A *worker* is anything the daemon starts and must stop (a looping thread, a gRPC,
unix socket or HTTP server), all with the same four calls (``Worker``). Each start is
followed at once by its stop's registration on a ``contextlib.ExitStack``, so stops run
in reverse order, also when a later start fails.

A ``ThreadWorker`` never dies silently: an exception escaping its loop is logged at
CRITICAL and kept in ``failure``, and ``alive`` turns False. Started through
:class:`Workers` it runs again after ``RESTART_BACKOFF_SECONDS`` (one step per death in
a row; a run of ``RESTART_RESET_SECONDS`` starts over); past the last step it stays
dead, and the run loop stops pinging systemd's watchdog so systemd restarts the daemon.

A ThreadWorker that runs but cannot do its job (the watchdog unable to judge the
node's GPU processes) says why in ``problem``; the run loop treats it as dead until
it clears it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol, TypedDict, TypeVar

log = logging.getLogger(__name__)

JOIN_TIMEOUT_SECONDS = 2.0
# All workers together: the daemon must exit within a second of SIGTERM.
STOP_BUDGET_SECONDS = 0.6
# Together well under systemd's WatchdogSec (60 s): a worker that comes back in time
# does not restart the daemon.
RESTART_BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0)
RESTART_RESET_SECONDS = 60.0


class WorkerHealth(TypedDict):
    """One worker as the status document and the metrics show it."""

    up: bool
    restarts: int
    failure: str | None  # "<ExceptionType>: <message>" of its last death
    problem: str | None


class Worker(Protocol):
    name: str

    def start(self) -> None:
        """Returns once the worker serves (sockets bound, thread started)."""
        ...

    def stop(self) -> None:
        """Ask the worker to stop; returns at once (servers may finish it here)."""
        ...

    def join(self, timeout_seconds: float) -> bool:
        """True once the worker has ended."""
        ...

    @property
    def alive(self) -> bool:
        """Started, not stopped, and not failed."""
        ...


W = TypeVar("W", bound=Worker)


def running(
    stack: contextlib.ExitStack, worker: W, join_timeout_seconds: float = JOIN_TIMEOUT_SECONDS
) -> W:
    worker.start()
    stack.callback(stop_and_join, worker, join_timeout_seconds)
    return worker


def stop_and_join(worker: Worker, timeout_seconds: float = JOIN_TIMEOUT_SECONDS) -> bool:
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
        self.failure: BaseException | None = None
        self.problem: str | None = None  # set and cleared by the worker itself
        self.restarts = 0
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
    """The workers a daemon started, on one ExitStack.

    ``stop_all_first`` (once, after the last start) asks every worker to stop before
    the joins run, so they overlap and share one ``stop_budget_seconds``: a worker stuck
    past it (a command to a hung MPS daemon) is left behind, logged, and the daemon
    exits on time (its threads are daemon threads).
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
        """Start ``worker`` and register its stop; only a ThreadWorker is restarted."""
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
        return [worker.name for worker in self._started if not worker.alive]

    def problems(self) -> list[str]:
        return [
            f"{worker.name}: {worker.problem}"
            for worker in self._started
            if isinstance(worker, ThreadWorker) and worker.alive and worker.problem
        ]

    def health(self) -> dict[str, WorkerHealth]:
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
